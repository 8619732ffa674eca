"""FeatCal on tiny decoder-only causal LMs: padding on either side, counted tokens (``response_only``), Gemma's
``1 + weight`` norms, Qwen2's biases, batching and the Surgery feature site. What every family keeps is in
test_family_contract.py (run there on Llama, Mistral, Qwen2 and Gemma-2)."""

import copy
import json

import pytest
import torch
from datasets import Dataset

from featcal_fusionbench.models.task_switch import LMHeadSurgery
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.families import family_for
from featcal_fusionbench.families.causal_lm import (
    CausalLMFamily,
    OffsetRMSNormSite,
    collate,
    position_ids_from_mask,
)
from featcal_fusionbench.families.sites import RMSNormSite
from featcal_fusionbench.core.hparams import FeatCalHParams

from helpers import (
    CHAT, byte_tokenizer, causal_lm_batch, causal_lm_forward, independent_linear_solve, perturbed, recorded_inputs,
    tiny_causal_lm, tiny_causal_lm_world,
)

ARCHS = ("llama", "mistral", "qwen2", "gemma2")
LINEARS = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]


def calibrate(merged, base, experts, data, family_options=None, **overrides):
    hp = FeatCalHParams(**{"num_calibration_examples": 8, "batch_size": 4, **overrides})
    engine = FeatCalEngine(CausalLMFamily(**(family_options or {})), hp, "cpu", progress=False)
    report = engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    return merged, report


def walk(family, model, batch):
    """The last layer's output, one layer at a time."""
    with torch.no_grad():
        hidden, meta = family.embed(model, batch)
        for block in family.blocks(model):
            hidden = family.run_block(block, hidden, meta)
    return hidden, meta


def last_layer_output(model, batch):
    """The model's own last-layer output (before the final norm), from its forward at generate's positions."""
    captured = []
    layer = model.model.layers[-1]
    handle = layer.register_forward_hook(lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        causal_lm_forward(model, batch)
    handle.remove()
    return captured[0]


# ---- the walk ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_left_and_right_padding_give_each_token_the_state_of_its_row_alone(arch, attn):
    """The walk's per-token states on a left- and on a right-padded batch equal the model's own forward on each
    row without padding (positions from the attention mask; sliding windows of 4 on rows up to 9 long)."""
    model = tiny_causal_lm(arch, attn_implementation=attn)
    family = family_for(model)
    lengths = [9, 4, 7]
    right, left = (causal_lm_batch(lengths, seed=3, pad_to=11, left=side) for side in (False, True))
    assert torch.equal(right["input_ids"][right["attention_mask"].bool()], left["input_ids"][left["attention_mask"].bool()])
    walked = {side: walk(family, model, batch)[0] for side, batch in (("right", right), ("left", left))}
    for i, n in enumerate(lengths):
        alone = {"input_ids": right["input_ids"][i : i + 1, :n], "attention_mask": torch.ones(1, n, dtype=torch.long)}
        expected = last_layer_output(model, alone)[0]
        torch.testing.assert_close(walked["right"][i, :n], expected, rtol=1e-5, atol=1e-5, msg=f"right, row {i}")
        torch.testing.assert_close(walked["left"][i, -n:], expected, rtol=1e-5, atol=1e-5, msg=f"left, row {i}")
    for side, batch in (("right", right), ("left", left)):
        torch.testing.assert_close(walked[side], last_layer_output(model, batch), rtol=0, atol=0, msg=side)


def test_the_bare_decoder_is_walked_like_the_causal_lm():
    model = tiny_causal_lm("gemma2")
    batch = causal_lm_batch([6, 3], left=True)
    assert isinstance(family_for(model.model), CausalLMFamily)
    torch.testing.assert_close(walk(CausalLMFamily(), model.model, batch)[0], walk(CausalLMFamily(), model, batch)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_masks_and_rotary_embeddings_follow_the_models_dtype(dtype):
    model = tiny_causal_lm("gemma2", attn_implementation="eager").to(dtype)  # eager: additive float masks
    hidden, meta = CausalLMFamily().embed(model, causal_lm_batch([5, 3], left=True))
    assert hidden.dtype == dtype
    assert all(t.dtype == dtype for t in meta.position_embeddings)
    assert set(meta.masks) == {"full_attention", "sliding_attention"}
    assert all(mask.dtype == dtype for mask in meta.masks.values())
    assert not torch.equal(meta.masks["full_attention"], meta.masks["sliding_attention"])


def test_positions_count_real_tokens_on_either_side():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 1, 1]]


# ---- sites: Gemma's 1 + weight, Qwen2's biases --------------------------------------------------------------


def test_sites_are_the_projections_and_norms_in_forward_order():
    llama = CausalLMFamily().sites(tiny_causal_lm("llama").model.layers[0])
    assert list(llama) == ["input_layernorm", *LINEARS[:4], "post_attention_layernorm", *LINEARS[4:]]
    assert all(type(llama[n]) is RMSNormSite for n in ("input_layernorm", "post_attention_layernorm"))
    gemma = CausalLMFamily().sites(tiny_causal_lm("gemma2").model.layers[0])
    assert list(gemma) == [
        "input_layernorm", *LINEARS[:4], "post_attention_layernorm", "pre_feedforward_layernorm", *LINEARS[4:],
        "post_feedforward_layernorm",
    ]
    assert all(isinstance(gemma[n], OffsetRMSNormSite) for n in gemma if n.endswith("layernorm"))


def test_gemma_norm_sites_read_and_write_the_scale_the_model_applies():
    """Gemma's RMSNorm computes normalize(x) * (1 + weight): the site's scale is 1 + weight, a solved scale s is
    stored as s - 1, and reading then writing back is bit-exact in every dtype."""
    norm = tiny_causal_lm("gemma2").model.layers[0].input_layernorm
    site = OffsetRMSNormSite(norm)
    x = torch.randn(3, 5, norm.weight.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(norm(x), site.normalizer()(x) * site.weight.float())
        torch.testing.assert_close(site.weight, norm.weight.double() + 1)
        site.write(weight=torch.full_like(site.weight, 0.25))
    assert torch.all(norm.weight == -0.75)
    with pytest.raises(ValueError, match="no shift"):
        site.write(bias=torch.zeros(1))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = copy.deepcopy(tiny_causal_lm("gemma2").model.layers[1].post_feedforward_layernorm).to(dtype)
        stored = norm.weight.detach().clone()
        site = OffsetRMSNormSite(norm)
        site.write(weight=site.weight)
        assert torch.equal(norm.weight, stored), dtype


def test_qwen2_qkv_biases_are_calibrated_only_with_calibrate_bias():
    base, experts, merged, data = tiny_causal_lm_world("qwen2")
    names = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"]
    original = merged.state_dict()
    with_bias, _ = calibrate(copy.deepcopy(merged), base, experts, data)
    without, _ = calibrate(copy.deepcopy(merged), base, experts, data, calibrate_bias=False)
    for name in names:
        assert not torch.allclose(with_bias.state_dict()[name], original[name]), name
        assert torch.equal(without.state_dict()[name], original[name]), name
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(with_bias.state_dict()[name], original[name]), name


# ---- which tokens count ---------------------------------------------------------------------------------------


def _module_inputs(model, index, names, batches, counted):
    """One layer's module inputs over all batches from the model's own forward, counted tokens only."""
    collected = recorded_inputs(model.model.layers[index], names,
                                lambda: [causal_lm_forward(model, batch) for batch in batches])
    return {n: torch.cat([x[counted(b)] for x, b in zip(xs, batches)]).double() for n, xs in collected.items()}


@pytest.mark.parametrize("response_only", [False, True], ids=["all-tokens", "response-only"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_each_layer_is_solved_on_the_counted_tokens_of_the_calibrated_prefix(arch, response_only):
    """Layer l's weights, biases and norm scales equal an independent least-squares solve over the counted tokens
    (non-padding, or response tokens with ``response_only``) that the final model feeds layer l with layer l still
    merged. Gemma's scales are solved as 1 + weight; left padding (Llama, Gemma-2) and right padding (Qwen2)."""
    base, experts, merged, data = tiny_causal_lm_world(arch, left=arch != "qwen2")
    original = copy.deepcopy(merged)
    lam, rho, alpha = 0.05, 2.0, 0.6
    calibrated, _ = calibrate(
        merged, base, experts, data, {"response_only": response_only}, lambda_=lam, rho=rho, alpha=alpha,
        accumulation_dtype="float64",
    )

    def counted(batch):
        mask = batch["attention_mask"].bool()
        return mask & batch["response_mask"].bool() if response_only else mask

    family = CausalLMFamily()
    tasks = list(experts)
    for index in range(2):
        snapshot = copy.deepcopy(calibrated)
        snapshot.model.layers[index].load_state_dict(original.model.layers[index].state_dict())
        norms = [n for n, s in family.sites(original.model.layers[index]).items() if s.kind == "rmsnorm"]
        x_cal = {t: _module_inputs(snapshot, index, LINEARS + norms, data[t], counted) for t in tasks}
        x_exp = {t: _module_inputs(experts[t], index, LINEARS, data[t], counted) for t in tasks}
        sites = {
            key: family.sites(m.model.layers[index])
            for key, m in (("merged", original), ("base", base), ("got", calibrated), *experts.items())
        }
        for name in LINEARS:
            def param(key, attr, name=name):
                return getattr(sites[key][name], attr)

            has_bias = param("merged", "bias") is not None
            weight, bias = independent_linear_solve(
                [x_cal[t][name] for t in tasks], [x_exp[t][name] for t in tasks], [param(t, "weight") for t in tasks],
                [param(t, "bias") for t in tasks] if has_bias else None,
                rho * param("merged", "weight") + (1 - rho) * param("base", "weight"),
                rho * param("merged", "bias") + (1 - rho) * param("base", "bias") if has_bias else None,
                lam, alpha, 1e-8,
            )
            msg = f"layer {index} {name}"
            torch.testing.assert_close(param("got", "weight").double(), weight, rtol=1e-4, atol=1e-5, msg=msg)
            if has_bias:
                torch.testing.assert_close(param("got", "bias").double(), bias, rtol=1e-4, atol=1e-5, msg=msg)
        for name in norms:
            # Each coordinate: sum_i mean_tokens (g z - g_i z)^2 + lam (g - anchor)^2, in the scale the model applies.
            eps = sites["merged"][name].module.eps if arch == "gemma2" else sites["merged"][name].module.variance_epsilon
            applied = {key: sites[key][name].module.weight.double() + (arch == "gemma2") for key in sites}
            anchor = rho * applied["merged"] + (1 - rho) * applied["base"]
            zs = {t: x_cal[t][name] / x_cal[t][name].pow(2).mean(-1, keepdim=True).add(eps).sqrt() for t in tasks}
            q = {t: zs[t].pow(2).mean(0) for t in tasks}
            expected = (sum(q[t] * applied[t] for t in tasks) + lam * anchor) / (sum(q.values()) + lam)
            torch.testing.assert_close(applied["got"], expected, rtol=1e-4, atol=1e-5, msg=f"layer {index} {name}")


def o_proj_error(accumulation_dtype: str, lam: float = 1e-5) -> float:
    """Layer 0's calibrated ``o_proj`` weight at the paper's LLM values (lambda 1e-5 for 3B, rho 0.5, alpha 0.15),
    relative to an independent float64 solve on the same tokens (Frobenius norms)."""
    base, experts, merged, data = tiny_causal_lm_world("llama", left=True)
    original = copy.deepcopy(merged)
    rho, alpha, name = 0.5, 0.15, "self_attn.o_proj"
    calibrated, _ = calibrate(merged, base, experts, data, lambda_=lam, rho=rho, alpha=alpha,
                              accumulation_dtype=accumulation_dtype)
    tasks = list(experts)
    counted = lambda batch: batch["attention_mask"].bool()  # noqa: E731
    x_cal = [_module_inputs(original, 0, [name], data[t], counted)[name] for t in tasks]
    x_exp = [_module_inputs(experts[t], 0, [name], data[t], counted)[name] for t in tasks]
    site = lambda model: model.model.layers[0].self_attn.o_proj.weight.detach().double()  # noqa: E731
    expected, _ = independent_linear_solve(x_cal, x_exp, [site(experts[t]) for t in tasks], None,
                                           rho * site(original) + (1 - rho) * site(base), None, lam, alpha, 1e-8)
    return float((site(calibrated) - expected).norm() / expected.norm())


def test_float64_statistics_are_exact_at_the_3b_lambda_where_float32_ones_are_not():
    """With two query heads per key/value head, o_proj's inputs are near-duplicates and the ridge system at lambda
    1e-5 has a condition number near 1e5: float32 moments put the solution about 1e-3 (relative) from an independent
    float64 solve, float64 moments within 1e-5. At the 8B lambda (3.0) the ridge term conditions the system and
    float32 moments are exact enough. Hence `accumulation_dtype: float64` in the configs at lambda 1e-5
    (docs/families/causal_lm.md)."""
    assert o_proj_error("float64") < 1e-5
    assert o_proj_error("float32") > 1e-4
    assert o_proj_error("float32", lam=3.0) < 1e-5


def test_response_only_with_every_token_a_response_is_the_default():
    base, experts, merged, data = tiny_causal_lm_world("llama")
    everything = {t: [{**b, "response_mask": b["attention_mask"]} for b in batches] for t, batches in data.items()}
    default, _ = calibrate(copy.deepcopy(merged), base, experts, data, accumulation_dtype="float64")
    responses, _ = calibrate(copy.deepcopy(merged), base, experts, everything, {"response_only": True}, accumulation_dtype="float64")
    only_answers, _ = calibrate(copy.deepcopy(merged), base, experts, data, {"response_only": True}, accumulation_dtype="float64")
    for (name, p), q, r in zip(default.named_parameters(), responses.parameters(), only_answers.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.allclose(default.model.layers[0].mlp.down_proj.weight, only_answers.model.layers[0].mlp.down_proj.weight)


def test_response_only_without_a_response_mask_is_named():
    base, experts, merged, data = tiny_causal_lm_world("llama")
    stripped = {t: [{k: v for k, v in b.items() if k != "response_mask"} for b in bs] for t, bs in data.items()}
    with pytest.raises(ValueError, match="response_only=true needs a 'response_mask'"):
        calibrate(merged, base, experts, stripped, {"response_only": True})
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="response_only=true needs a 'response_mask' column"):
        CausalLMFamily(response_only=True).batches(None, dataset, 2)
    with pytest.raises(ValueError, match="response_only must be true or false"):
        CausalLMFamily(response_only="yes")


# ---- data --------------------------------------------------------------------------------------------------------


class _Tokenizer:
    pad_token_id = 7


class _Pool:
    tokenizer = "configured"

    def load_tokenizer(self):
        return _Tokenizer()


def test_batches_right_pad_with_the_pools_pad_id_and_drop_trailing_padding():
    dataset = Dataset.from_dict({
        "input_ids": [[5, 6, 9, 9], [4, 3, 2], [8]],
        "attention_mask": [[1, 1, 0, 0], [1, 1, 1], [1]],
        "response_mask": [[0, 1, 0, 0], [0, 1, 1], [1]],
        "labels": [[0], [0], [0]],
    })
    first, second = CausalLMFamily().batches(_Pool(), dataset, batch_size=2)
    assert set(first) == {"input_ids", "attention_mask", "response_mask"}
    assert first["input_ids"].tolist() == [[5, 6, 9], [4, 3, 2]]
    assert first["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert first["response_mask"].tolist() == [[0, 1, 0], [0, 1, 1]]
    assert second["input_ids"].tolist() == [[8]]
    padded = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], pad_id=0)
    assert set(padded) == {"input_ids", "attention_mask"}
    assert padded["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    unmasked = Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    assert next(iter(CausalLMFamily().batches(_Pool(), unmasked, 2)))["input_ids"].tolist() == [[1, 2], [3, 7]]
    with pytest.raises(ValueError, match="or pre-tokenized 'input_ids'; the dataset has \\['text'\\]"):
        CausalLMFamily().batches(_Pool(), Dataset.from_dict({"text": ["hi"]}), 2)


# ---- Surgery's feature site ------------------------------------------------------------------------------------


@pytest.mark.parametrize("response_only", [False, True], ids=["all-tokens", "response-only"])
def test_the_feature_site_is_lm_heads_input_at_the_counted_tokens(response_only):
    model = tiny_causal_lm("qwen2")
    batch = causal_lm_batch([6, 2, 4], left=True)
    family = CausalLMFamily(response_only=response_only)
    site = family.feature_site(None, model)
    captured = []
    handle = model.lm_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.no_grad():
        causal_lm_forward(model, batch)
        features = site.features(model, batch)
    handle.remove()
    counted = batch["attention_mask"].bool() & (batch["response_mask"].bool() if response_only else True)
    assert site.dim == model.config.hidden_size and features.shape == (int(counted.sum()), site.dim)
    torch.testing.assert_close(features, captured[0][counted])
    with pytest.raises(TypeError, match="bare Qwen2Model has no lm_head"):
        family.feature_site(None, model.model)


def test_the_feature_site_deploys_on_lm_head():
    class Maps(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def compute_surgery_features(self, features, task):
            return features * 0, None, None

    model = tiny_causal_lm("llama")
    batch = {k: v for k, v in causal_lm_batch([4, 3]).items() if k != "response_mask"}
    with torch.no_grad():
        reference = model(**batch).logits
        deployed = CausalLMFamily().feature_site(None, model).deploy(Maps(model))
        assert isinstance(deployed, LMHeadSurgery)
        unchanged = deployed(**batch).logits
        deployed.active_task = "task0"
        zeroed = deployed(**batch).logits
    torch.testing.assert_close(unchanged, reference)
    torch.testing.assert_close(zeroed, torch.zeros_like(zeroed))


# ---- text calibration data, experts with other vocabularies, the command line ------------------------------------

@pytest.mark.parametrize("template", [CHAT, None], ids=["chat-template", "plain"])
def test_text_examples_are_encoded_with_the_response_marked(template):
    from featcal_fusionbench.families.causal_lm import tokenize_prompt_response

    tokenizer = byte_tokenizer(template)
    row = tokenize_prompt_response(tokenizer, "2+2?", "4", max_length=64)
    ids, response = row["input_ids"], row["response_mask"]
    assert len(ids) == len(response) == len(row["attention_mask"])
    answer = [i for i, r in zip(ids, response) if r]
    assert tokenizer.decode(answer) == "4</s>"
    prompt = tokenizer.decode([i for i, r in zip(ids, response) if not r])
    assert prompt == ("<user>2+2?</s><assistant>" if template else "2+2?</s>")  # ByT5 ends every text with eos
    cut = tokenize_prompt_response(tokenizer, "2+2?", "4", max_length=3)
    assert cut["input_ids"] == ids[:3] and cut["response_mask"] == [0, 0, 0]


def test_the_alpaca_text_format_lays_the_prompt_out_in_alpacas_template_even_with_a_chat_template():
    from featcal_fusionbench.families.causal_lm import CausalLMFamily, tokenize_prompt_response

    tokenizer = byte_tokenizer(CHAT)
    row = tokenize_prompt_response(tokenizer, "2+2?", "4", max_length=512, text_format="alpaca")
    ids, response = row["input_ids"], row["response_mask"]
    prompt = tokenizer.decode([i for i, r in zip(ids, response) if not r])
    assert prompt == ("Below is an instruction that describes a task. Write a response that appropriately completes "
                      "the request.\n\n### Instruction:\n2+2?\n\n### Response:\n</s>")
    assert tokenizer.decode([i for i, r in zip(ids, response) if r]) == "4</s>"
    assert CausalLMFamily().option_values["text_format"] == "chat_template"
    with pytest.raises(ValueError, match="text_format must be one of"):
        CausalLMFamily(text_format="vicuna")


def test_text_datasets_are_batched_through_the_pools_tokenizer_and_bad_columns_are_named():
    from datasets import Dataset

    class Pool:
        tokenizer = "bytes"

        def load_tokenizer(self):
            return byte_tokenizer(CHAT)

    family = CausalLMFamily(response_only=True, max_length=32)
    data = Dataset.from_dict({"prompt": ["a", "longer prompt"], "response": ["b", "c"], "label": [0, 1]})
    (batch,) = list(family.batches(Pool(), data, batch_size=2))
    # "<user>a</s><assistant>b</s>": 21 tokens, the last two the response; the second row (33) is cut to 32
    assert batch["input_ids"].shape == (2, 32) and batch["attention_mask"].sum(1).tolist() == [21, 32]
    assert batch["response_mask"].sum(1).tolist() == [2, 1]
    with pytest.raises(ValueError, match="'prompt' and 'response' text or pre-tokenized 'input_ids'"):
        family.batches(Pool(), Dataset.from_dict({"text": ["x"]}), 1)
    with pytest.raises(ValueError, match="max_length must be an integer of at least 2"):
        CausalLMFamily(max_length=1)


def test_fields_of_any_dataset_become_prompt_and_response():
    from datasets import Dataset

    from featcal_fusionbench.integration.text_data import prompt_response

    rows = Dataset.from_dict({"instruction": ["Add", "Sort"], "input": ["1 and 2", ""], "output": ["3", "ok"]})
    pairs = prompt_response(rows, ["instruction", "input"], "output")
    assert pairs.column_names == ["prompt", "response"]
    assert pairs[0] == {"prompt": "Add\n\n1 and 2", "response": "3"} and pairs[1]["prompt"] == "Sort"
    with pytest.raises(ValueError, match=r"no field\(s\) \['query'\]"):
        prompt_response(rows, "query", "output")
    # Alpaca's `input` is optional (MergeBench reads it only where present); the first field and the response are not
    no_input = Dataset.from_dict({"instruction": ["Add 1 and 2"], "output": ["3"]})
    assert prompt_response(no_input, ["instruction", "input"], "output")[0] == {"prompt": "Add 1 and 2", "response": "3"}
    with pytest.raises(ValueError, match=r"no field\(s\) \['output'\]"):
        prompt_response(no_input.rename_column("output", "answer"), ["instruction", "input"], "output")


def test_an_expert_with_a_larger_vocabulary_is_tolerated_and_another_shape_is_not():
    from featcal_fusionbench.integration.post_merging import PostMergingMixin

    base = tiny_causal_lm("llama")
    wider = tiny_causal_lm("llama", seed=1, vocab=80)  # MergeBench's experts: more rows than their base
    class Pool:
        def load_model(self, name):
            return {"wider": wider, "other": tiny_causal_lm("llama", seed=2, hidden=48)}[name]

    assert PostMergingMixin().load_experts(Pool(), ["wider"], base)["wider"] is wider
    with pytest.raises(ValueError, match="different shape for model.layers.0"):
        PostMergingMixin().load_experts(Pool(), ["other"], base)


def fusion_bench_run(cwd, *args):
    import commands

    done = commands.run("fusion_bench", *args, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_featcal_runs_through_the_cli_on_a_causal_lm_pool_with_text_examples(tiny_llama_pool, tmp_path, dtype):
    """`fusion_bench method=featcal/causal_lm_ta` on a CausalLMPool on disk, scored by lm-eval tasks over local
    files (LMEvalTaskPool): Task Arithmetic over the layers only
    (merge_backbone), the examples encoded with the tokenizer's chat template, the calibrated model saved in the
    pool's dtype (bf16 as MergeBench's pools load their models; the moments stay float32, the solves float64)."""
    import json

    from transformers import AutoModelForCausalLM

    fusion_bench_run(
        tmp_path, "method=featcal/causal_lm_ta", "method.num_calibration_examples=8", "method.batch_size=4",
        tiny_llama_pool["search"], "modelpool=tiny_llama", f"+modelpool.model_kwargs.torch_dtype={dtype}",
        "taskpool=LMEvalHarnessTaskPool/tiny_llama", f"path.log_dir={tmp_path / 'log'}",
        f"merged_model_save_path={tmp_path / 'calibrated'}", f"report_save_path={tmp_path / 'scores.json'}",
    )
    scores = json.loads((tmp_path / "scores.json").read_text())  # lm-eval's scores of the calibrated model
    assert set(scores) >= {"tiny_sums", "tiny_text", "average"} and 0 <= scores["tiny_sums"]["score"] <= 1
    assert scores["tiny_text"]["score"] > 0 and (tmp_path / "log" / "lm_eval_results" / "tiny_text.json").is_file()
    report = json.loads((tmp_path / "log" / "featcal_report.json").read_text())
    assert report["upstream"] == "method:fusion_bench.method.TaskArithmeticForCausalLM" and len(report["blocks"]) == 2
    calibrated = AutoModelForCausalLM.from_pretrained(tmp_path / "calibrated", torch_dtype="auto")
    assert calibrated.dtype == getattr(torch, dtype)
    assert all(torch.isfinite(p).all() for p in calibrated.parameters())
    state = calibrated.float().state_dict()
    base_state = tiny_llama_pool["base"].to(getattr(torch, dtype)).float().state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], base_state["model.embed_tokens.weight"])  # backbone only
    assert not torch.allclose(state["model.layers.1.mlp.down_proj.weight"], base_state["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["surgery", "probsurgery"])
def test_the_baselines_train_their_maps_on_lm_heads_input_through_the_cli(tiny_llama_pool, tmp_path, baseline):
    import json

    fusion_bench_run(
        tmp_path, f"method={baseline}/causal_lm_ta", "method.num_calibration_examples=8", "method.max_steps=3",
        "method.batch_size=4", tiny_llama_pool["search"], "modelpool=tiny_llama",
        "taskpool=LMEvalHarnessTaskPool/tiny_llama", f"path.log_dir={tmp_path}", f"report_save_path={tmp_path / 'scores.json'}",
    )
    scores = json.loads((tmp_path / "scores.json").read_text())  # each task evaluated under its expert's map
    assert torch.isfinite(torch.tensor(scores["tiny_text"]["score"])) and "average" in scores
    report = json.loads((tmp_path / f"{baseline}_report.json").read_text())
    assert report["features"] == "streamed" and report["max_steps"] == 3
    assert report["upstream"] == "method:fusion_bench.method.TaskArithmeticForCausalLM"
    assert set(report["final_loss"]) == {"math", "coding"}  # one map per expert, trained on its text examples
    assert all(torch.isfinite(torch.tensor(v)) for v in report["final_loss"].values())


def test_a_saved_merged_model_is_loaded_in_the_bases_dtype(tmp_path):
    """`method.merged_model_path` (the reproduction runner's calibrator runs): from_pretrained alone would load a
    bf16 LLM in float32, twice its memory."""
    from featcal_fusionbench.integration.upstream import load_merged_model

    base = tiny_causal_lm("llama").to(torch.bfloat16)
    base.save_pretrained(tmp_path / "merged")
    merged, source = load_merged_model(type("Pool", (), {"has_merged": False})(), None, str(tmp_path / "merged"), None, base)
    assert merged.dtype == torch.bfloat16 and source == f"path:{tmp_path / 'merged'}"


def mergekit_layout(model, folder):
    """``model`` saved as mergekit writes a merge: safetensors shards, their index and the config."""
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


def edit_checkpoint(folder, edit):
    """Apply ``edit`` (a function of the tensors' dict) to every shard and rewrite the index."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted({*index["weight_map"].values()}):
        tensors = edit(load_file(folder / shard))
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def never_loaded(monkeypatch, cls):
    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained ran before the checkpoint was checked")

    monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda *a, **k: refuse()))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_merge_written_as_mergekit_writes_it_is_checked_and_loaded(arch, tmp_path):
    """Sharded safetensors with an index: every tensor named and shaped as the base's (Gemma-2's tied head stored
    once, as the embedding) loads, equal to what was saved."""
    from featcal_fusionbench.integration.upstream import load_saved_model

    base = tiny_causal_lm(arch)
    if arch == "gemma2":
        base.config.tie_word_embeddings = True
        base.tie_weights()
    merged = perturbed(base, 0.05, 1)
    loaded = load_saved_model(str(mergekit_layout(merged, tmp_path / "merge")), base)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), merged.state_dict().values()))


@pytest.mark.parametrize("edit, named", [
    (lambda t: {k.replace("layers.1.mlp.down_proj", "layers.1.mlp.down"): v for k, v in t.items()},
     ["model.layers.1.mlp.down_proj.weight (32, 48) is missing",
      "model.layers.1.mlp.down.weight (32, 48) is not a tensor of the pretrained model"]),
    (lambda t: {k: v[:, :40].contiguous() if k == "model.layers.0.mlp.down_proj.weight" else v for k, v in t.items()},
     ["model.layers.0.mlp.down_proj.weight is (32, 40) where the pretrained model has (32, 48)"]),
    (lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"}, ["model.norm.weight (32,) is missing"]),
], ids=["renamed", "reshaped", "missing"])
def test_a_merge_whose_tensors_differ_from_the_bases_fails_naming_them_before_any_is_read(edit, named, tmp_path,
                                                                                            monkeypatch):
    from featcal_fusionbench.integration.upstream import load_saved_model

    base = tiny_causal_lm("llama")
    folder = mergekit_layout(base, tmp_path / "merge")
    edit_checkpoint(folder, edit)
    never_loaded(monkeypatch, type(base))
    with pytest.raises(ValueError) as error:
        load_saved_model(str(folder), base)
    assert str(error.value).startswith(f"merged_model_path at {folder} does not match the pretrained model: ")
    assert all(n in str(error.value) for n in named), str(error.value)


def test_a_full_clip_checkpoint_read_as_its_vision_tower_is_not_refused_for_its_text_tower(tmp_path):
    """A CLIPModel folder holds the text tower too, which CLIPVisionModel.from_pretrained leaves out by design; a
    missing vision tensor is still named."""
    from transformers import CLIPModel, CLIPVisionModel

    from featcal_fusionbench.models.checks import check_checkpoint_matches
    from toy_world import tiny_clip_config

    full = CLIPModel(tiny_clip_config(64))
    full.save_pretrained(tmp_path / "clip")
    tower = CLIPVisionModel.from_pretrained(tmp_path / "clip")
    assert check_checkpoint_matches(tmp_path / "clip", tower, "expert 'x'")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "clip" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "vision_model.post_layernorm.weight"},
              tmp_path / "clip" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"vision_model\.post_layernorm\.weight \(32,\) is missing"):
        check_checkpoint_matches(tmp_path / "clip", tower, "expert 'x'")


def test_an_expert_or_pool_merge_whose_tensors_differ_fails_before_the_pool_loads_it(tmp_path):
    """The same check for the pool's experts and its `_merged_`, which the pool would load with from_pretrained."""
    from fusion_bench.modelpool import CausalLMPool

    from featcal_fusionbench.integration.post_merging import PostMergingMixin
    from featcal_fusionbench.integration.upstream import load_merged_model

    base = tiny_causal_lm("llama")
    base.save_pretrained(tmp_path / "base")
    for name in ("math", "merged"):
        edit_checkpoint(mergekit_layout(perturbed(base, 0.05, 1), tmp_path / name),
                        lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    pool = CausalLMPool(models={"_pretrained_": str(tmp_path / "base"), "math": str(tmp_path / "math"),
                                "_merged_": str(tmp_path / "merged")}, tokenizer=None)
    with pytest.raises(ValueError, match=r"expert 'math' at .* does not match the pretrained model: model\.norm\.weight \(32,\) is missing"):
        PostMergingMixin().load_experts(pool, ["math"], base)
    with pytest.raises(ValueError, match=r"the pool's `_merged_` at .* model\.norm\.weight \(32,\) is missing"):
        load_merged_model(pool, None, None, None, base)


@pytest.mark.slow
def test_lazy_loading_and_out_of_core_through_the_cli_calibrate_exactly_as_whole_models(tiny_llama_pool, tmp_path):
    """`method.models_in_memory=merged`: the base and experts are read from the pool's safetensors folders one block
    at a time; `=none`: the Task Arithmetic merge too, computed tensor by tensor, and the calibrated
    model is written block by block to `merged_model_save_path` (shards and their index), then loaded for the task
    pool. The calibrated model is the same, bit for bit."""
    from featcal_fusionbench.models.lazy import CheckpointTensors

    common = ("method=featcal/causal_lm_ta", "method.num_calibration_examples=8", "method.batch_size=4",
              tiny_llama_pool["search"], "modelpool=tiny_llama", "taskpool=dummy")
    runs = {"whole": ("method.models_in_memory=all",), "lazy": ("method.models_in_memory=merged",),
            "out_of_core": ("method.models_in_memory=none",)}
    for name, options in runs.items():
        fusion_bench_run(tmp_path, *common, *options, f"path.log_dir={tmp_path / name}",
                         f"merged_model_save_path={tmp_path / name / 'calibrated'}")
    saved = {}
    for name in runs:
        tensors = CheckpointTensors(tmp_path / name / "calibrated")
        saved[name] = tensors.read(tensors.files)
    assert all(saved[name].keys() == saved["whole"].keys() for name in runs)
    assert all(torch.equal(saved[name][k], saved["whole"][k]) for name in runs for k in saved["whole"])
    assert (tmp_path / "out_of_core" / "calibrated" / "model.safetensors.index.json").is_file()  # not saved twice
    reports = {name: json.loads((tmp_path / name / "featcal_report.json").read_text()) for name in runs}
    assert [r["models_in_memory"] for r in reports.values()] == ["all", "merged", "none"]
    assert reports["out_of_core"]["upstream"] == "method:fusion_bench.method.TaskArithmeticForCausalLM (out of core)"