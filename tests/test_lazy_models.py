"""Lazy base / expert models: sharded checkpoints, tied parameters, residency, and what is refused."""

import pytest
import torch
from fusion_bench.modelpool import CausalLMPool

from featcal_fusionbench.models.residency import on_device
from featcal_fusionbench.models.lazy import CheckpointTensors, load_lazily, load_pool_model_lazily

from helpers import tiny_causal_lm


def test_a_sharded_checkpoint_is_read_one_block_at_a_time(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(set(CheckpointTensors(tmp_path).files.values())) > 2
    lazy = load_lazily(type(model), tmp_path)
    block, reference = lazy.model.layers[1], model.model.layers[1]
    with on_device([block], torch.device("cpu")):
        assert all(torch.equal(a, b) for a, b in zip(block.state_dict().values(), reference.state_dict().values()))
        assert all(p.is_meta for p in lazy.model.layers[0].parameters())  # only what is in use is read
    assert all(p.is_meta for p in block.parameters())


def test_tensors_are_read_into_aligned_allocations_of_their_own_equal_to_safetensors_load(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {  # odd sizes put most tensors at unaligned offsets of the file
        "a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 3, generator=g, dtype=torch.float64), "d": torch.tensor(3), "e": torch.zeros(0, 4),
        "f": torch.tensor([True, False, True]), "g": torch.randn(5, 3, generator=g).half(),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    read = CheckpointTensors(tmp_path).read(tensors)
    expected = load_file(str(tmp_path / "model.safetensors"))
    for name, value in read.items():
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name])
        assert value.data_ptr() % 64 == 0 or value.numel() == 0
    assert len({v.untyped_storage().data_ptr() for v in read.values() if v.numel()}) == len(tensors) - 1
    save_file({"x": torch.zeros(2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError, match="x in .* is stored as F8_E4M3"):
        CheckpointTensors(tmp_path).read(["x"])


def test_a_tied_parameter_is_read_under_the_name_the_checkpoint_holds(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in CheckpointTensors(tmp_path)
    lazy = load_lazily(LlamaForCausalLM, tmp_path)
    with on_device([lazy.lm_head], torch.device("cpu")):
        assert torch.equal(lazy.lm_head.weight, model.model.embed_tokens.weight)


def test_the_pools_entries_are_resolved_and_what_cannot_be_read_lazily_is_named(tmp_path):
    model = tiny_causal_lm("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "base")
    (tmp_path / "empty").mkdir()
    pool = CausalLMPool(models={"_pretrained_": str(tmp_path / "base"), "live": model, "empty": str(tmp_path / "empty")},
                        tokenizer=None, model_kwargs={"torch_dtype": "bfloat16"})
    lazy = load_pool_model_lazily(pool, "_pretrained_")
    assert type(lazy) is type(model) and lazy.dtype == torch.bfloat16  # the pool's model_kwargs
    with pytest.raises(TypeError, match="'live' is a live module"):
        load_pool_model_lazily(pool, "live")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pool_model_lazily(pool, "empty")
