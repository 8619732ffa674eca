"""What only a CUDA device can check (issue 62): the streams on the device with pinned-host and disk spill, the
automatic device budget from free device memory, bf16 models with float32 and float64 statistics, out of core with
the device as compute and the host as store, and two devices where there are two. Skipped (and said so) without
CUDA; ``bash scripts/gpu_check.sh`` runs them first on a machine that has it.

Each compares the device's calibration with the host's in float64-accumulated statistics, to a tolerance: kernels
differ between devices, so bit equality is asked only where both runs are on the device."""

import copy

import pytest
import torch

from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.engine.streams import StreamOptions
from featcal_fusionbench.families import family_for

from helpers import tiny_causal_lm_world, tiny_world

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run bash scripts/gpu_check.sh on one"),
]


def calibrate(world, device, dtype=torch.float32, accumulation="float32", streams=None):
    base, experts, merged, data = world
    base, merged = base.to(dtype), copy.deepcopy(merged).to(dtype)
    experts = {t: e.to(dtype) for t, e in experts.items()}
    hp = FeatCalHParams(lambda_=1e-3, rho=1.0, alpha=0.3, accumulation_dtype=accumulation)
    engine = FeatCalEngine(family_for(base), hp, torch.device(device), progress=False, streams=streams)
    report = engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    return {k: v.detach().float().cpu() for k, v in merged.state_dict().items()}, report


def assert_close(got, expected, rtol):
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=rtol * float(value.abs().max()), msg=key)


@pytest.mark.parametrize("spill", ["host", "disk"])
def test_streams_spilled_from_the_device_to_pinned_host_or_disk_calibrate_as_kept_on_it(spill, tmp_path):
    world = tiny_world(batches=4)
    kept, _ = calibrate(world, "cuda")
    spilled, report = calibrate(world, "cuda", streams=StreamOptions(0, spill, str(tmp_path)))
    assert report["streams"]["peak_spilled_bytes"] > 0 and report["streams"]["peak_resident_bytes"] == 0
    for key, value in kept.items():
        assert torch.equal(spilled[key], value), key  # both on the device: bit for bit


def test_the_automatic_budget_is_a_share_of_the_free_device_memory():
    world = tiny_world(batches=4)
    _, report = calibrate(world, "cuda", streams=StreamOptions(None))
    free, _ = torch.cuda.mem_get_info()
    streams = report["streams"]
    assert streams["device_budget"] == "auto" and 0 < streams["device_budget_bytes"] < free


@pytest.mark.parametrize("accumulation", ["float32", "float64"])
def test_bf16_models_with_float32_or_float64_statistics_calibrate_as_on_the_host(accumulation):
    world = tiny_causal_lm_world("llama", batches=2)
    device, report = calibrate(world, "cuda", torch.bfloat16, accumulation)
    host, _ = calibrate(world, "cpu", torch.bfloat16, accumulation)
    assert all(torch.isfinite(v).all() for v in device.values())
    assert_close(device, host, rtol=2e-2)  # bf16 parameters: a few of their ulps
    assert report["statistics_bytes"] > 0


def _on(device, pool, output=None, **options):
    """The method on ``pool`` with Fabric on ``device`` (FusionBench's program would set it up from its config)."""
    import types

    import lightning as L

    from featcal_fusionbench import FeatCalAlgorithm
    from test_out_of_core import ARGS

    method = FeatCalAlgorithm(**{**ARGS, **options})
    method._fabric_instance = L.Fabric(accelerator=device, devices=1)
    method._program = types.SimpleNamespace(merged_model_save_path=None if output is None else str(output),
                                            log_dir=None, _taskpool=object())
    return method.run(pool)


def test_out_of_core_computes_on_the_device_and_keeps_the_models_on_the_host(tmp_path):
    """Base, experts and merge read a block at a time from their checkpoints onto the device; the written model
    equals the whole-model run on the device, and the host run to float rounding."""
    from test_out_of_core import TA_BACKBONE, llama_pool, state

    pool = llama_pool(tmp_path)
    whole = _on("cuda", pool, upstream=TA_BACKBONE)
    assert next(whole.parameters()).device.type == "cuda"
    written = _on("cuda", pool, tmp_path / "out", upstream=TA_BACKBONE, models_in_memory="none")
    host = _on("cpu", pool, upstream=TA_BACKBONE)
    whole = {k: v.cpu() for k, v in state(whole).items()}
    assert_close({k: v.cpu() for k, v in state(written).items()}, whole, rtol=1e-6)
    assert_close(whole, state(host), rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one CUDA device: the two-device check needs two")
def test_two_devices_calibrate_as_one(toy_world, tmp_path):
    """Two ranks on two devices (NCCL; spawned, as CUDA cannot be forked) give the single-device calibration."""
    from test_distributed import assert_two_ranks_match_one

    assert_two_ranks_match_one("cuda", "ddp_spawn", toy_world["modelpool"], tmp_path)
