"""The contract every model family keeps, run over every family by parametrisation.

A new family is one ``Case`` in ``CASES``: how to build a tiny base, experts, merged model and calibration
batches, how to run the model's own forward, and which sites a ``module_regex`` picks. Families with a
Surgery / ProbSurgery feature site also name the pool fixture the baselines run on.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from featcal_fusionbench import ProbSurgeryAlgorithm, SurgeryAlgorithm
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.models.residency import on_device
from featcal_fusionbench.engine.plan import plan_blocks
from featcal_fusionbench.families import family_class_for, family_for, register_family
from featcal_fusionbench.families.causal_lm import CausalLMFamily
from featcal_fusionbench.families.clip_vision import CLIPVisionFamily
from featcal_fusionbench.families.openclip_vision import OpenCLIPVisionFamily
from featcal_fusionbench.families.t5 import T5Family
from featcal_fusionbench.families.sites import first_tensor
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.engine.streams import StreamOptions
from fusion_bench.utils import instantiate

from fused_family import FusedAttentionFamily, tiny_fused
from helpers import (
    causal_lm_forward, perturbed, task_arithmetic, tiny_causal_lm_world, tiny_openclip_world, tiny_t5_world, tiny_world,
)

TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


def fused_world(num_tasks: int = 2, seed: int = 0):
    base = tiny_fused(seed)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    return base, experts, merged, {t: [torch.randn(4, 5, 6, generator=g) for _ in range(3)] for t in experts}


@dataclass
class Case:
    family: type
    world: Callable[[], tuple]  # (base, experts, merged, {task: [batch, ...]})
    forward: Callable  # the model's own forward on one batch
    regex: str  # a module_regex that selects some sites but not all
    examples: int  # examples per task in the world's batches
    pools: Optional[Dict[str, str]] = None  # Surgery contract: pool fixture, modelpool and taskpool config keys
    label: Optional[str] = None  # test id where one family has several cases (one per architecture)

    @property
    def id(self) -> str:
        return self.label or self.family.name


def causal_lm_case(arch: str) -> Case:
    # The Surgery contract runs on Llama, whose pool is on disk with an lm-eval task pool; the other
    # architectures share its feature site (lm_head's input).
    pools = {"fixture": "tiny_llama_pool", "modelpool": "modelpool/tiny_llama.yaml",
             "taskpool": "taskpool/LMEvalHarnessTaskPool/tiny_llama.yaml"}
    return Case(
        CausalLMFamily, lambda: tiny_causal_lm_world(arch, left=arch in ("llama", "gemma2")), causal_lm_forward,
        r"mlp\.down_proj$|self_attn\.v_proj$", 8, pools if arch == "llama" else None, label=f"causal_lm-{arch}",
    )


CASES = [
    Case(
        CLIPVisionFamily, tiny_world, lambda m, x: m(pixel_values=x), r"mlp\.fc[12]$", 12,
        {"fixture": "toy_world", "modelpool": "modelpool", "taskpool": "taskpool"},
    ),
    Case(
        T5Family, lambda: tiny_t5_world(pad_to=12, target_pad_to=7), lambda m, b: m(**b), r"DenseReluDense\.wo$", 6,
        {"fixture": "tiny_t5_pool", "modelpool": "modelpool/Seq2SeqLMPool/tiny_t5.yaml", "taskpool": "taskpool/tiny_t5_text.yaml"},
    ),
    Case(FusedAttentionFamily, fused_world, lambda m, x: m(x), r"attn\.in_proj\.[qv]$|c_fc$", 12),
    # OpenCLIP as FusionBench's pool serves it (ImageEncoder); with layer scale; with the (L, N, D) blocks of
    # towers pickled by open_clip 2.0.2.
    Case(OpenCLIPVisionFamily, tiny_openclip_world, lambda m, x: m(x), r"attn\.in_proj\.[qv]$|mlp\.c_fc$", 12),
    Case(
        OpenCLIPVisionFamily, lambda: tiny_openclip_world(layer_scale=0.5), lambda m, x: m(x), r"ls_[12]$", 12,
        label="openclip_vision-layer_scale",
    ),
    Case(
        OpenCLIPVisionFamily, lambda: tiny_openclip_world(batch_first=False), lambda m, x: m(x), r"attn\.out_proj$", 12,
        label="openclip_vision-seq_first",
    ),
    *(causal_lm_case(arch) for arch in ("llama", "mistral", "qwen2", "gemma2")),
]
SURGERY_CASES = [c for c in CASES if c.pools]


def calibrate(case: Case, merged, base, experts, data, family_options=None, engine=None, **overrides):
    """``overrides`` are hyperparameters; ``engine`` holds FeatCalEngine's keyword options."""
    hp = FeatCalHParams(**{"num_calibration_examples": case.examples, "batch_size": 4, **overrides})
    family = case.family(**(family_options or {}))
    report = FeatCalEngine(family, hp, "cpu", progress=False, **(engine or {})).run(
        merged, base, experts, {t: iter(v) for t, v in data.items()}
    )
    return merged, report


def site_values(family, model):
    """Every site's (weight, bias) per block, as copies."""
    out = {}
    for index, block in enumerate(family.blocks(model)):
        for name, site in family.sites(block).items():
            clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
            out[index, name] = (clone(site.weight), clone(site.bias))
    return out


def restore_sites(family, model, values, keys=None) -> None:
    """Write the given site values back (all sites, or ``keys``)."""
    blocks = family.blocks(model)
    for (index, name), (weight, bias) in values.items():
        if keys is None or (index, name) in keys:
            family.sites(blocks[index])[name].write(weight=weight, bias=bias)


def assert_same_state(model, reference, msg=""):
    ref = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref[key]), f"{msg}{key}"


@pytest.fixture(params=CASES, ids=lambda c: c.id)
def case(request):
    return request.param


def test_the_family_is_found_for_its_model(case):
    base = case.world()[0]
    assert family_class_for(base) is case.family
    assert case.family.supports(base) and not any(c.family.supports(base) for c in CASES if c.family is not case.family)


def test_the_block_walk_reproduces_the_models_own_forward(case):
    """The input of every block and the last block's output, walked one block at a time, equal the model's own
    forward (captured by hooks on the blocks), padding included where the family has it."""
    family = case.family()
    base, _, _, data = case.world()
    blocks = family.blocks(base)
    seen = {}
    handles = [b.register_forward_pre_hook(lambda _m, a, k, i=i: seen.__setitem__(i, first_tensor(a, k)), with_kwargs=True)
               for i, b in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(lambda _m, _a, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out)))
    batch = next(iter(data.values()))[0]
    with torch.no_grad():
        case.forward(base, batch)
        for h in handles:
            h.remove()
        hidden, meta = family.embed(base, batch)
        for index, block in enumerate(blocks):
            hidden, meta = family.enter_block(base, index, hidden, meta)
            torch.testing.assert_close(hidden, seen[index], msg=f"input of block {index}")
            hidden = family.run_block(block, hidden, meta)
    torch.testing.assert_close(hidden, seen["out"], msg="output of the last block")


def test_each_block_is_fitted_on_the_calibrated_prefix(case):
    """Re-solving block l alone, on a model whose other blocks are already calibrated, gives the full run's
    block l: the full run fitted it on the calibrated prefix, not on the merged one."""
    base, experts, merged, data = case.world()
    family = case.family()
    merged_sites = site_values(family, merged)
    full, _ = calibrate(case, copy.deepcopy(merged), base, experts, data)
    full_sites = site_values(family, full)
    blocks = family.blocks(full)
    names = {id(m): n for n, m in full.named_modules()}
    for index in (1, len(blocks) - 1):
        model = copy.deepcopy(full)
        keys = {k for k in merged_sites if k[0] == index}
        restore_sites(family, model, merged_sites, keys)
        regex = "^" + re.escape(names[id(blocks[index])]) + r"\."
        calibrate(case, model, base, experts, data, module_regex=regex)
        again = site_values(family, model)
        for key in keys:
            for got, expected in zip(again[key], full_sites[key]):
                if expected is not None:
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=str(key))
        # and the merged prefix would have given something else
        assert any(not torch.allclose(again[k][0], merged_sites[k][0]) for k in keys)


def test_experts_equal_to_merged_with_alpha0_rho1_leave_the_model_unchanged(case):
    base, experts, merged, data = case.world()
    experts = {t: copy.deepcopy(merged) for t in experts}
    original = copy.deepcopy(merged)
    calibrated, report = calibrate(case, merged, base, experts, data, alpha=0.0, rho=1.0, accumulation_dtype="float64")
    assert any(b["modules"] for b in report["blocks"])
    for (name, p), q in zip(calibrated.named_parameters(), original.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_huge_lambda_returns_the_anchor_and_nothing_else_moves(case):
    base, experts, merged, data = case.world()
    family = case.family()
    original = copy.deepcopy(merged)
    rho = 1.5
    calibrated, _ = calibrate(case, merged, base, experts, data, lambda_=1e9, rho=rho)
    got, before, base_sites = (site_values(family, m) for m in (calibrated, original, base))
    for key, values in got.items():
        for value, m, b in zip(values, before[key], base_sites[key]):
            if value is not None:
                torch.testing.assert_close(value, rho * m + (1 - rho) * b, rtol=1e-4, atol=1e-5, msg=str(key))
    restore_sites(family, calibrated, before)
    assert_same_state(calibrated, original, "outside the sites: ")


def test_module_regex_calibrates_only_the_selected_sites(case):
    base, experts, merged, data = case.world()
    family = case.family()
    original = copy.deepcopy(merged)
    calibrated, report = calibrate(case, merged, base, experts, data, module_regex=case.regex)
    pattern = re.compile(case.regex)
    reported = [m for b in report["blocks"] for m in b["modules"]]
    assert reported and all(pattern.search(m) for m in reported)
    got, before = site_values(family, calibrated), site_values(family, original)
    changed = {key for key in got if not torch.equal(got[key][0], before[key][0])}
    assert changed and all(pattern.search(name) for _, name in changed)
    restore_sites(family, calibrated, before)
    assert_same_state(calibrated, original)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_models_calibrate_close_to_float32(case, dtype):
    """Moments in float32 whatever the model's dtype; parameters written back in the model's dtype."""
    base, experts, merged, data = case.world()
    reference, _ = calibrate(case, copy.deepcopy(merged), base, experts, data)
    low = lambda m: copy.deepcopy(m).to(dtype)  # noqa: E731
    calibrated, report = calibrate(case, low(merged), low(base), {t: low(e) for t, e in experts.items()}, data)
    assert report["statistics_bytes"] > 0
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for (name, p), q in zip(calibrated.named_parameters(), reference.parameters()):
        assert p.dtype == dtype and torch.isfinite(p).all(), name
        error = (p.float() - q).norm() / q.norm().clamp_min(1e-6)
        assert error < tolerance, (name, float(error))


def test_base_and_experts_are_untouched_and_shared_modules_return_once(case, monkeypatch):
    base, experts, merged, data = case.world()
    family = case.family()
    states = {name: copy.deepcopy(m) for name, m in [("base", base), *experts.items()]}
    calibrate(case, merged, base, experts, data)
    for name, model in [("base", base), *experts.items()]:
        assert_same_state(model, states[name], f"{name}: ")
    # The stem may list one module twice (T5's shared embedding): it must move there and back once.
    moved = []
    original_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(id(self)) or original_to(self, *a, **k))
    stem = family.stem_modules(merged) + [family.blocks(merged)[0]]
    with on_device(stem + stem, torch.device("cpu")):
        pass
    assert sorted(moved) == sorted(2 * list({id(m) for m in stem}))


def test_bad_family_options_and_selections_are_named(case):
    base = case.world()[0]
    with pytest.raises(ValueError, match=f"{case.family.name} family has no option.*no_such_option"):
        family_for(base, {"no_such_option": 1})
    for option in case.family.options:
        with pytest.raises(ValueError, match=option):
            family_for(base, {option: -1.0})
    with pytest.raises(ValueError, match="no module selected.*nothing_matches"):
        plan_blocks(case.family(), base, FeatCalHParams(module_regex="nothing_matches"))


NOT_TRANSFORMERS = (FusedAttentionFamily, OpenCLIPVisionFamily)


@pytest.mark.parametrize("lazy_case", [c for c in CASES if c.family not in NOT_TRANSFORMERS], ids=lambda c: c.id)
def test_base_and_experts_read_block_by_block_from_their_checkpoints_calibrate_the_same(lazy_case, tmp_path):
    """``lazy_loading``: the base and experts are skeletons that read each block from safetensors when the engine
    uses it and release it after. (The fused test family and OpenCLIP are no transformers models: their
    checkpoints are no safetensors.)"""
    from featcal_fusionbench.models.lazy import load_lazily

    base, experts, merged, data = lazy_case.world()
    lazy = {}
    for name, model in {"base": base, **experts}.items():
        model.save_pretrained(tmp_path / name)
        lazy[name] = load_lazily(type(model), tmp_path / name, model.dtype)
        assert all(p.is_meta for p in lazy[name].parameters())
    eager, _ = calibrate(lazy_case, copy.deepcopy(merged), base, experts, data)
    lazily, _ = calibrate(lazy_case, copy.deepcopy(merged), lazy["base"], {t: lazy[t] for t in experts}, data)
    assert_same_state(lazily, eager)
    assert all(p.is_meta for m in lazy.values() for p in m.parameters())  # nothing left resident


@pytest.mark.parametrize("spill", ["host", "disk"])
def test_streams_spilled_beyond_a_budget_calibrate_bit_identically(case, spill, tmp_path):
    """``stream_device_bytes`` / ``stream_spill``: with no stream byte on the device, or half of them, the batches
    beyond the budget go to host memory or disk and come back exactly, metadata included (T5's decoder state,
    Llama's masks and rotary tables): the same parameters and drift, bit for bit. The upstream stream is tracked so
    that all three streams of a task are spilled."""
    base, experts, merged, data = case.world()
    whole, whole_report = calibrate(case, copy.deepcopy(merged), base, experts, data, engine={"track_upstream": True})
    held = whole_report["streams"]["peak_resident_bytes"]
    assert held > 0 and whole_report["streams"]["peak_spilled_bytes"] == 0  # unbounded on CPU by default
    for budget in (0, held // 2):
        options = StreamOptions(budget, spill, str(tmp_path))
        spilled, report = calibrate(case, copy.deepcopy(merged), base, experts, data,
                                    engine={"track_upstream": True, "streams": options})
        assert_same_state(spilled, whole, f"budget {budget}: ")
        assert [b["drift"] for b in report["blocks"]] == [b["drift"] for b in whole_report["blocks"]]
        streams = report["streams"]
        assert streams["peak_resident_bytes"] <= budget < held and streams["peak_spilled_bytes"] > 0
        assert streams["spill_read_bytes"] > 0
    assert not any(tmp_path.iterdir())  # the disk spill's folder is gone


def test_an_unknown_model_and_a_second_family_of_the_same_name_are_refused():
    with pytest.raises(TypeError, match="no model family for Linear; registered families: .*clip_vision"):
        family_for(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already registered"):
        register_family(type("Clone", (CLIPVisionFamily,), {}))


@pytest.mark.parametrize("cls", [SurgeryAlgorithm, ProbSurgeryAlgorithm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("surgery_case", SURGERY_CASES, ids=lambda c: c.id)
def test_baselines_at_zero_steps_evaluate_exactly_like_the_upstream_model(surgery_case, cls, request):
    """Through the family's feature site and the task pool's own evaluation: untrained maps are the identity."""
    world = request.getfixturevalue(surgery_case.pools["fixture"])

    def config(key):
        path = surgery_case.pools[key]
        return world[path] if path in world else f"{world['config_dir']}/{path}"

    algo = cls(upstream=TA, num_calibration_examples=8, max_steps=0, batch_size=4, return_upstream=True)
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    out = algo.run(instantiate(OmegaConf.load(config("modelpool"))))
    taskpool = instantiate(OmegaConf.load(config("taskpool")))
    taskpool._fabric_instance = algo.fabric

    def scores(model):
        report = taskpool.evaluate(model)
        return {t: v for t, v in report.items() if isinstance(v, dict) and t != "model_info"}

    key = cls.method_name.lower()
    assert out[key].is_surgery_model
    assert scores(out[key]) == scores(out["upstream"])


def test_the_clip_family_reads_a_pools_processor_once_for_all_its_tasks():
    from datasets import Dataset
    from PIL import Image

    class Pool:
        loads = 0

        def load_processor(self):
            Pool.loads += 1
            return lambda image: torch.full((3, 2, 2), float(image.getpixel((0, 0))[0]))

    images = Dataset.from_dict({"image": [Image.new("RGB", (2, 2), (v, 0, 0)) for v in (1, 2, 3)], "label": [0, 1, 0]})
    family, pool = CLIPVisionFamily(), Pool()
    for _task in range(3):
        batches = [b[:, 0, 0, 0].tolist() for b in family.batches(pool, images, batch_size=2)]
        assert batches == [[1.0, 2.0], [3.0]]
    assert Pool.loads == 1
    list(family.batches(Pool(), images, batch_size=2))  # another pool: its own processor
    assert Pool.loads == 2
