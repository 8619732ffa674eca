"""``method.out_of_core``: the merged model read block by block and the calibrated one written block by block, equal
bit for bit to the whole-model path, complete or absent on disk whatever happens."""

import errno
import json
import types

import pytest
import torch
from helpers import byte_tokenizer, perturbed, tiny_causal_lm

from featcal_fusionbench.integration.algorithm import FeatCalAlgorithm

TA_BACKBONE = {"_target_": "fusion_bench.method.TaskArithmeticForCausalLM", "scaling_factor": 0.3,
               "merge_backbone": True, "model_save_path": None}
TA_WHOLE = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3}
ARGS = {"num_calibration_examples": 8, "batch_size": 4, "lambda_": 1e-3, "rho": 0.5, "alpha": 0.15}


def llama_pool(root, arch="llama", dtype=None, merged=None):
    """A CausalLMPool on disk: a tiny base with a tokenizer, two experts, token-id examples; ``merged``: a
    ``_merged_`` model saved beside them."""
    from datasets import Dataset
    from fusion_bench.modelpool import CausalLMPool

    base = tiny_causal_lm(arch, vocab=384)
    base.config.rope_theta = 1e5  # not the default: a config that loses it changes the model (below)
    if arch == "gemma2":  # a tied head: written once, as the embedding
        base.config.tie_word_embeddings = True
        base.tie_weights()
    base.save_pretrained(root / "base")
    byte_tokenizer().save_pretrained(root / "base")
    models, train = {"_pretrained_": str(root / "base")}, {}
    for i, task in enumerate(("math", "coding")):
        perturbed(base, 0.05, 10 + i).save_pretrained(root / task)
        models[task] = str(root / task)
        ids = torch.randint(1, 384, (12, 9), generator=torch.Generator().manual_seed(i)).tolist()
        Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 9] * 12}).save_to_disk(root / f"{task}_data")
        train[task] = {"_target_": "datasets.load_from_disk", "dataset_path": str(root / f"{task}_data")}
    merge = None if merged is None else merged(base)
    if merge is not None:
        merge.save_pretrained(root / "merged", max_shard_size="20KB")  # sharded, as mergekit writes
        models["_merged_"] = str(root / "merged")
    kwargs = {"torch_dtype": dtype} if dtype else {}
    return CausalLMPool(models=models, train_datasets=train, tokenizer=str(root / "base"), model_kwargs=kwargs)


def calibrate(pool, output=None, taskpool=True, **options):
    """Run the method as FusionBench's program does; the program's save path is ``output``."""
    method = FeatCalAlgorithm(**{**ARGS, **options})
    method._program = types.SimpleNamespace(merged_model_save_path=None if output is None else str(output),
                                            log_dir=None, _taskpool=object() if taskpool else None)
    return method.run(pool), method._program


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


@pytest.mark.parametrize("upstream, dtype", [(TA_BACKBONE, None), (TA_WHOLE, None), (TA_BACKBONE, "bfloat16")])
def test_task_arithmetic_out_of_core_equals_fusion_benchs_eager_merge_and_calibration(upstream, dtype, tmp_path):
    pool = llama_pool(tmp_path, dtype=dtype)
    eager, _ = calibrate(pool, upstream=upstream)
    out = tmp_path / "calibrated"
    loaded, program = calibrate(pool, out, upstream=upstream, models_in_memory="none")
    assert_equal(state(eager), state(loaded))
    assert loaded.dtype == eager.dtype
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer_config.json"} <= files
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) == 2 + 3  # a shard per block, then embedding, final norm, head
    assert program.merged_model_save_path is None  # written already: the program does not save it again
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_saved_merge_is_calibrated_out_of_core_exactly_as_whole(arch, tmp_path):
    """``merged_model_path`` (a sharded checkpoint, as mergekit writes one) and the pool's ``_merged_``; Gemma-2's
    tied head is written once, as the embedding, and loads tied."""
    pool = llama_pool(tmp_path, arch, merged=lambda base: perturbed(base, 0.02, 5))
    eager, _ = calibrate(pool)
    from_pool, _ = calibrate(pool, tmp_path / "a", models_in_memory="none")
    from_path, _ = calibrate(pool, tmp_path / "b", models_in_memory="none", merged_model_path=str(tmp_path / "merged"))
    assert_equal(state(eager), state(from_pool))
    assert_equal(state(eager), state(from_path))
    written = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in written) == (arch == "llama")


def test_a_merge_whose_config_json_transformers_5_wrote_is_read_with_the_bases_config(tmp_path, caplog):
    """mergekit 0.1.5 (transformers 5) writes rope_theta inside rope_parameters, where transformers 4.x does not
    look: it would fall back to 10000 without a word. The merge has the base's architecture, so its config is used,
    and the difference is named."""
    pool = llama_pool(tmp_path, merged=lambda base: perturbed(base, 0.02, 5))
    expected, _ = calibrate(pool)  # the pool's `_merged_`, its config as saved
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    (tmp_path / "merged" / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        eager, _ = calibrate(pool, merged_model_path=str(tmp_path / "merged"))
        out_of_core, _ = calibrate(pool, tmp_path / "a", models_in_memory="none", merged_model_path=str(tmp_path / "merged"))
    assert_equal(state(expected), state(eager))
    assert_equal(state(expected), state(out_of_core))
    assert "rope_parameters={'rope_theta': 100000.0, 'rope_type': 'default'} (unknown to the base)" in caplog.text


def test_without_a_task_pool_nothing_is_loaded_and_the_default_folder_is_under_the_log_dir(tmp_path, monkeypatch):
    """Also: large allocations are memory-mapped first (glibc: this machine's C library)."""
    import featcal_fusionbench.integration.algorithm as algorithm
    from featcal_fusionbench.integration.out_of_core import map_large_allocations

    mapped = []
    monkeypatch.setattr(algorithm, "map_large_allocations", lambda: mapped.append(map_large_allocations()))
    pool = llama_pool(tmp_path)
    method = FeatCalAlgorithm(**ARGS, upstream=TA_BACKBONE, models_in_memory="none")
    method._program = types.SimpleNamespace(merged_model_save_path=None, log_dir=str(tmp_path / "log"), _taskpool=None)
    assert method.run(pool) is None
    assert mapped == [True]
    assert (tmp_path / "log" / "featcal_model" / "model.safetensors.index.json").is_file()


def test_the_output_is_loaded_with_the_pools_device_map_and_the_save_path_may_name_the_log_dir(tmp_path):
    from featcal_fusionbench.integration.out_of_core import output_path

    pool = llama_pool(tmp_path, dtype="bfloat16")
    pool.model_kwargs["device_map"] = "cpu"  # a model larger than one device: from_pretrained places it
    loaded, _ = calibrate(pool, tmp_path / "calibrated", upstream=TA_BACKBONE, models_in_memory="none")
    assert loaded.hf_device_map == {"": torch.device("cpu")} and loaded.dtype == torch.bfloat16
    assert output_path("{log_dir}/merged", "/logs/run") == "/logs/run/merged"
    assert output_path(None, "/logs/run") == "/logs/run/featcal_model"
    with pytest.raises(ValueError, match="set merged_model_save_path"):
        output_path(None, None)


def _stop_at_block(monkeypatch, stop_index, error=KeyboardInterrupt):
    """Stop the run when block ``stop_index`` is handed to the calibrated model's sink (the blocks before it are
    written)."""
    from featcal_fusionbench.models.sinks import CheckpointSink

    block = CheckpointSink.block

    def stopping(self, index, *args, **kwargs):
        if index == stop_index and self.writer is not None and self.writer.label == "the calibrated model":
            raise error
        return block(self, index, *args, **kwargs)

    monkeypatch.setattr(CheckpointSink, "block", stopping)


def test_an_interrupted_run_keeps_the_previous_output_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Ctrl-C at the second block: the output of an earlier run is kept as it was, the first block stays in a
    hidden partial folder that no loader takes for a model; another configuration is refused, naming it; the same
    command resumes at the second block and ends bit for bit as a run never stopped."""
    from featcal_fusionbench.models.checkpoint_writer import partial_folder, read_progress

    pool = llama_pool(tmp_path)
    out = tmp_path / "calibrated"
    first, _ = calibrate(pool, out, upstream=TA_BACKBONE, models_in_memory="none")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    uninterrupted, _ = calibrate(pool, tmp_path / "reference", upstream=TA_BACKBONE, models_in_memory="none", lambda_=1.0)
    with monkeypatch.context() as patch:
        _stop_at_block(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            calibrate(pool, out, upstream=TA_BACKBONE, models_in_memory="none", lambda_=1.0)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    partial = partial_folder(out)
    assert sorted(read_progress(partial)["blocks"]) == ["0"]
    assert not (partial / "model.safetensors.index.json").exists()
    with pytest.raises(ValueError, match=r"whose configuration differ\(s\) .* remove .*\.calibrated\.partial"):
        calibrate(pool, out, upstream=TA_BACKBONE, models_in_memory="none", lambda_=0.5)
    resumed, _ = calibrate(pool, out, upstream=TA_BACKBONE, models_in_memory="none", lambda_=1.0)
    assert_equal(state(uninterrupted), state(resumed))
    assert not partial.exists()


def test_a_disk_that_fills_fails_naming_it_and_removes_the_partial_output(tmp_path, monkeypatch):
    import safetensors.torch

    pool = llama_pool(tmp_path)
    calls = []

    def full(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save_file(tensors, path, metadata=metadata)

    save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match=r"the disk filled while the calibrated model was written to .*calibrated"):
        calibrate(pool, tmp_path / "calibrated", upstream=TA_BACKBONE, models_in_memory="none")
    assert not (tmp_path / "calibrated").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_too_little_free_disk_fails_before_calibration(tmp_path, monkeypatch):
    import shutil

    import featcal_fusionbench.engine.loop as loop

    pool = llama_pool(tmp_path)
    full = types.SimpleNamespace(total=1 << 30, used=1 << 30, free=1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    monkeypatch.setattr(loop.FeatCalEngine, "run", lambda *a, **k: pytest.fail("calibration started"))
    # sizes in the unit that shows them: the tiny model's checkpoint is some KiB, not "0.00 GiB"
    with pytest.raises(OSError, match=r"the calibrated model needs [1-9][0-9.]* KiB and .* has 1000 B free"):
        calibrate(pool, tmp_path / "calibrated", upstream=TA_BACKBONE, models_in_memory="none")
    assert not (tmp_path / "calibrated").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_written_shards_are_as_readable_as_the_config_the_umask_allows(umask, tmp_path):
    """safetensors 0.8 writes every file 0o600 (its issue #782): another account could read the config and not the
    weights. The shards get the mode any file of the folder gets, ``0o666 & ~umask``."""
    import os
    import stat

    pool = llama_pool(tmp_path)
    out = tmp_path / "calibrated"
    previous = os.umask(umask)
    try:
        calibrate(pool, out, upstream=TA_BACKBONE, models_in_memory="none")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    shards = [name for name in modes if name.endswith(".safetensors")]
    assert len(shards) == 5
    assert {modes[name] for name in shards} == {modes["config.json"]} == {0o666 & ~umask}


@pytest.mark.parametrize("upstream, holder", [(TA_BACKBONE, "coding"), (TA_WHOLE, "_pretrained_"),
                                              ({"_target_": "fusion_bench.method.TiesMergingForCausalLM",
                                                "scaling_factor": 0.3, "threshold": 20, "remove_keys": [],
                                                "merge_func": "sum", "merge_backbone": True, "model_save_path": None},
                                               "math")])
def test_a_nan_in_one_checkpoint_is_named_by_the_model_that_holds_it(upstream, holder, tmp_path):
    """Out of core the merge is computed as it is read: its non-finite tensor names the base or the expert whose
    checkpoint holds the NaN, not the merge."""
    from safetensors.torch import load_file, save_file

    pool = llama_pool(tmp_path)
    folder = tmp_path / ("base" if holder == "_pretrained_" else holder)
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key][2, 3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    who = "the base" if holder == "_pretrained_" else f"the expert {holder!r}"
    with pytest.raises(ValueError, match=rf"{key} in .* has non-finite values, from {who} \({folder}\)$"):
        calibrate(pool, tmp_path / "calibrated", upstream=upstream, models_in_memory="none")


@pytest.mark.parametrize("options, message", [
    ({"upstream": {"_target_": "fusion_bench.method.SimpleAverageAlgorithm"}},
     "the upstream fusion_bench.method.SimpleAverageAlgorithm would build it whole"),
    ({"upstream": {**TA_BACKBONE, "model_save_path": "somewhere"}}, "set upstream.model_save_path=null"),
    ({"upstream": TA_BACKBONE, "auto_select": {"criterion": "drift"}}, "out of core, use criterion objective"),
    ({"upstream": TA_BACKBONE, "auto_select": {"criterion": "site"}}, "'site' calibrates a copy .* use criterion objective"),
    ({"upstream": TA_BACKBONE, "auto_select": {"alpha_criterion": "drift"}},
     "out of core, set auto_select.alpha_criterion=none"),
])
def test_what_out_of_core_cannot_do_is_refused_before_any_model_is_read(options, message, tmp_path, monkeypatch):
    from featcal_fusionbench.integration import post_merging

    pool = llama_pool(tmp_path)
    monkeypatch.setattr(post_merging.PostMergingMixin, "load_base_and_experts",
                        lambda *a, **k: pytest.fail("a model was read"))
    with pytest.raises(ValueError, match=message):
        calibrate(pool, tmp_path / "calibrated", models_in_memory="none", **options)


@pytest.mark.parametrize("dtypes", [("bfloat16",) * 3, ("float32", "bfloat16", "float32")])
def test_lazy_task_arithmetic_is_fusion_benchs_bit_for_bit_and_refuses_what_it_refuses(dtypes, tmp_path, monkeypatch):
    """Each model in the dtype a pool entry's ``torch_dtype`` loads it in; FusionBench refuses mixed dtypes. The merge
    runs a few elements at a time here, as it runs on a vocabulary-sized tensor."""
    from fusion_bench.method import TaskArithmeticAlgorithm

    from featcal_fusionbench.models import lazy_merge

    monkeypatch.setattr(lazy_merge, "_slices", lambda tensor: list(tensor.view(-1).split(7)))

    from featcal_fusionbench.models.lazy import load_lazily
    from featcal_fusionbench.models.lazy_merge import lazy_task_arithmetic
    from featcal_fusionbench.models.residency import on_device

    base = tiny_causal_lm("llama")
    dtypes = dict(zip(("base", "a", "b"), (getattr(torch, d) for d in dtypes)))
    models = {"base": base, "a": perturbed(base, 0.05, 1), "b": perturbed(base, 0.05, 2)}
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
    eager = {name: type(base).from_pretrained(tmp_path / name, torch_dtype=dtypes[name]) for name in models}
    lazy = {name: load_lazily(type(base), tmp_path / name, dtypes[name]) for name in models}
    fusion_bench = TaskArithmeticAlgorithm(scaling_factor=0.3)
    if len(set(dtypes.values())) > 1:
        with pytest.raises(ValueError, match="Dtype mismatch"):
            fusion_bench.run({"_pretrained_": eager["base"], "a": eager["a"], "b": eager["b"]})
        with pytest.raises(ValueError, match="Task Arithmetic of models in different dtypes"):
            lazy_task_arithmetic(lazy["base"], {"a": lazy["a"], "b": lazy["b"]}, 0.3)
        return
    merged = fusion_bench.run({"_pretrained_": eager["base"], "a": eager["a"], "b": eager["b"]})
    skeleton = lazy_task_arithmetic(lazy["base"], {"a": lazy["a"], "b": lazy["b"]}, 0.3)
    with on_device([skeleton], "cpu"):
        assert_equal(state(merged), state(skeleton))
    assert all(p.is_meta for p in skeleton.parameters())  # released again


TIES_BACKBONE = {"_target_": "fusion_bench.method.TiesMergingForCausalLM", "scaling_factor": 0.3, "threshold": 20,
                 "remove_keys": [], "merge_func": "sum", "merge_backbone": True, "model_save_path": None}


@pytest.mark.parametrize("arch, dtype, merge_func", [("llama", "float32", "sum"), ("llama", "bfloat16", "mean"),
                                                     ("gemma2", "float32", "max"), ("llama", "float64", "mean")])
def test_lazy_ties_merging_is_fusion_benchs_bit_for_bit(arch, dtype, merge_func, tmp_path, monkeypatch):
    """FusionBench's TIES trims each task vector at one threshold over the whole flattened model (a tied head counted
    twice, as its state dict lists it) and breaks sign ties by one majority over it: found here by passes over the
    checkpoints, the threshold by a radix selection on the bits (float64's four digits too), then merged a few
    elements at a time."""
    from fusion_bench.method import TiesMergingAlgorithm

    from featcal_fusionbench.models import lazy_merge
    from featcal_fusionbench.models.lazy import load_lazily
    from featcal_fusionbench.models.residency import on_device

    monkeypatch.setattr(lazy_merge, "_slices", lambda tensor: list(tensor.reshape(-1).split(7)))
    base = tiny_causal_lm(arch)
    if arch == "gemma2":
        base.config.tie_word_embeddings = True
        base.tie_weights()
    models = {"base": base, "a": perturbed(base, 0.05, 1), "b": perturbed(base, 0.05, 2), "c": perturbed(base, 0.05, 3)}
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
    dtype = getattr(torch, dtype)
    eager = {name: type(base).from_pretrained(tmp_path / name, torch_dtype=dtype) for name in models}
    eager = {"_pretrained_": eager.pop("base"), **eager}
    lazy = {name: load_lazily(type(base), tmp_path / name, dtype) for name in models}
    merged = TiesMergingAlgorithm(scaling_factor=0.3, threshold=20, remove_keys=[], merge_func=merge_func).run(eager)
    skeleton = lazy_merge.lazy_ties_merging(lazy.pop("base"), lazy, 0.3, 20, merge_func)
    with on_device([skeleton], "cpu"):
        assert_equal(state(merged), state(skeleton))


def test_ties_thresholds_are_torch_kthvalue_with_duplicates_zeros_and_every_width(tmp_path):
    """The radix selection against ``torch.kthvalue`` on magnitudes with many repeats, zeros and subnormals."""
    from safetensors.torch import save_file

    from featcal_fusionbench.models.lazy import CheckpointTensors
    from featcal_fusionbench.models.lazy_merge import TiesMergingTensors

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        base = {"x": torch.zeros(40, 25, dtype=dtype), "y": torch.zeros(333, dtype=dtype)}
        experts = []
        for e in range(3):
            values = {k: torch.randint(-6, 7, v.shape, generator=generator).to(dtype) * 0.25 for k, v in base.items()}
            values["y"][:50] = torch.randn(50, generator=generator, dtype=torch.float64).to(dtype) * 1e-30 * (e + 1)
            experts.append(values)
        folders = []
        for i, tensors in enumerate([base, *experts]):
            (tmp_path / f"{dtype}{i}").mkdir()
            save_file(tensors, str(tmp_path / f"{dtype}{i}" / "model.safetensors"))
            folders.append(CheckpointTensors(tmp_path / f"{dtype}{i}"))
        keys = ["x", "y", "x"]  # a tied tensor counts once per name
        for threshold in (20, 0.5, 97):
            ties = TiesMergingTensors(folders[0], folders[1:], keys, 1.0, threshold, "sum", [dtype] * 4)
            for e, values in enumerate(experts):
                flat = torch.cat([values["x"].reshape(-1), values["y"], values["x"].reshape(-1)])
                assert ties.k == flat.numel() - int(flat.numel() * (threshold / 100 if threshold > 1 else threshold))
                assert torch.equal(ties.kth[e], flat.abs().kthvalue(ties.k).values), (dtype, threshold, e)


TIES_WHOLE = {"_target_": "fusion_bench.method.TiesMergingAlgorithm", "scaling_factor": 0.3, "threshold": 20,
              "remove_keys": [], "merge_func": "mean"}


@pytest.mark.parametrize("upstream", [TIES_BACKBONE, TIES_WHOLE])
def test_ties_merging_out_of_core_equals_fusion_benchs_eager_merge_and_calibration(upstream, tmp_path):
    pool = llama_pool(tmp_path)
    eager, _ = calibrate(pool, upstream=upstream)
    loaded, _ = calibrate(pool, tmp_path / "calibrated", upstream=upstream, models_in_memory="none")
    assert_equal(state(eager), state(loaded))


def test_ties_merging_out_of_core_refuses_remove_keys(tmp_path):
    pool = llama_pool(tmp_path)
    with pytest.raises(ValueError, match="upstream.remove_keys .* is not supported"):
        calibrate(pool, tmp_path / "calibrated", upstream={**TIES_BACKBONE, "remove_keys": ["lm_head.weight"]},
                  models_in_memory="none")


def test_auto_select_runs_out_of_core_in_the_one_pass_bit_for_bit_as_in_memory(tmp_path):
    """Criterion objective out of core: each block chosen on held-out moments, then solved on all examples and
    written; no copy of the merged model and no second pass, and the same tensors as the whole-model run."""
    pool = llama_pool(tmp_path)
    auto = {"grid": {"lambda_": [1e-4, 1e-2, 1.0], "rho": [0.5, 2.0]}}
    eager, _ = calibrate(pool, upstream=TA_BACKBONE, auto_select=auto)
    loaded, _ = calibrate(pool, tmp_path / "a", upstream=TA_BACKBONE, models_in_memory="none", auto_select=auto)
    assert_equal(state(eager), state(loaded))
    fixed, _ = calibrate(pool, upstream=TA_BACKBONE)
    assert not torch.equal(state(fixed)["model.layers.0.self_attn.q_proj.weight"],
                           state(loaded)["model.layers.0.self_attn.q_proj.weight"]), "the choice changed nothing"


def test_return_upstream_out_of_core_writes_both_and_the_program_scores_them_one_at_a_time(tmp_path):
    """The upstream is written block by block as it is read, beside the calibrated model; FusionBench's program
    evaluates the returned dict's models in turn, and the first is released before the second is loaded."""
    from fusion_bench.programs.fabric_fusion_program import FabricModelFusionProgram

    pool = llama_pool(tmp_path)
    eager, _ = calibrate(pool, upstream=TA_BACKBONE, return_upstream=True)
    result, _ = calibrate(pool, tmp_path / "cal", upstream=TA_BACKBONE, models_in_memory="none", return_upstream=True)
    assert (tmp_path / "cal_upstream" / "model.safetensors.index.json").is_file()
    scored = []

    class TaskPool:
        def evaluate(self, model):
            alive = [name for name, earlier in scored if next(earlier.parameters()).device.type != "meta"]
            scored.append((len(scored), model))
            return {"alive_before": alive, "state": state(model)}

    report = FabricModelFusionProgram.evaluate_merged_model(None, TaskPool(), result)
    assert list(report) == ["upstream", "featcal", "featcal_calibration"]
    assert report["featcal"]["alive_before"] == [], "the upstream was still in memory when FeatCal's was loaded"
    for key in ("upstream", "featcal"):
        assert_equal(state(eager[key]), report[key]["state"])
    assert report["featcal_calibration"]["upstream"] == f"{eager['featcal_calibration']['upstream']} (out of core)"


def test_the_former_flags_still_work_with_a_warning_and_a_contradiction_is_refused():
    from featcal_fusionbench.integration.memory import resolve_setting

    with pytest.warns(FutureWarning, match=r"method.out_of_core=True is deprecated: use method.models_in_memory=none"):
        assert FeatCalAlgorithm(out_of_core=True).in_memory == "none"
    with pytest.warns(FutureWarning, match=r"use method.models_in_memory=merged"):
        assert resolve_setting("auto", True, None) == "merged"
    assert FeatCalAlgorithm().in_memory == "auto"
    with pytest.raises(ValueError, match=r"contradicts method.models_in_memory=all"), pytest.warns(FutureWarning):
        FeatCalAlgorithm(out_of_core=True, models_in_memory="all")
    with pytest.raises(ValueError, match=r"models_in_memory must be one of"):
        FeatCalAlgorithm(models_in_memory="some")


@pytest.mark.parametrize("times, expected", [(100, "all"), (6, "merged"), (2, "none")])
def test_auto_chooses_from_the_checkpoints_sizes_against_available_memory(times, expected, tmp_path, monkeypatch,
                                                                           caplog):
    """Four models (base, two experts, the merge) whole need 4 x one checkpoint's size: all of them in half of the
    available memory, else one in a quarter of it, else none."""
    from featcal_fusionbench.integration import memory

    pool = llama_pool(tmp_path)
    size = memory.checkpoint_bytes(str(tmp_path / "base"))
    assert size == sum(p.stat().st_size for p in (tmp_path / "base").glob("*.safetensors"))
    monkeypatch.setattr(memory, "available_bytes", lambda: times * size)
    method = FeatCalAlgorithm(**ARGS, upstream=TA_BACKBONE)
    with caplog.at_level("INFO"):
        method._choose_models_in_memory(pool, ["math", "coding"])
    assert method.in_memory == expected
    assert f"models_in_memory=auto: {expected} (4 models of" in caplog.text
    method = FeatCalAlgorithm(**ARGS, upstream={"_target_": "fusion_bench.method.SimpleAverageAlgorithm"})
    method._choose_models_in_memory(pool, ["math", "coding"])
    assert method.in_memory == ("all" if expected == "all" else "merged"), "the average cannot be read block by block"


@pytest.mark.parametrize("where", ["merged_model_path", "expert", "sharded merge"])
def test_a_truncated_checkpoint_is_named_before_any_model_loads(where, tmp_path, monkeypatch):
    """A safetensors file cut short (an interrupted copy) fails naming the file, from its header, whether it is
    method.merged_model_path, a pool entry or one shard of a sharded merge; safetensors' own error names no file."""
    from featcal_fusionbench.integration import post_merging

    pool = llama_pool(tmp_path, merged=lambda base: perturbed(base, 0.02, 5) if where == "sharded merge" else None)
    options = {"upstream": TA_BACKBONE}
    if where == "merged_model_path":
        perturbed(tiny_causal_lm("llama", vocab=384), 0.02, 5).save_pretrained(tmp_path / "single")
        damaged, options = tmp_path / "single" / "model.safetensors", {"merged_model_path": str(tmp_path / "single")}
    elif where == "expert":
        damaged = tmp_path / "math" / "model.safetensors"
    else:
        damaged = sorted((tmp_path / "merged").glob("*.safetensors"))[1]
        options = {}
    data = damaged.read_bytes()
    damaged.write_bytes(data[:-100])
    monkeypatch.setattr(post_merging.PostMergingMixin, "load_base_and_experts",
                        lambda *a, **k: pytest.fail("a model was read"))
    with pytest.raises(ValueError, match=rf"{damaged} is truncated or corrupt \(its header describes \d+ bytes of "
                                         rf"tensor data and the file holds \d+\); download or save it again"):
        calibrate(pool, **options)
