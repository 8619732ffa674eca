"""Two CPU processes (gloo) give the single-process result: shards plus all-reduced moments."""

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from featcal_fusionbench import FeatCalAlgorithm
from fusion_bench.utils import instantiate

pytestmark = pytest.mark.slow  # two gloo ranks in processes of their own

# The ranks are forked from this process (Lightning's ddp_fork), which has imported what they run: spawned
# (ddp_spawn), each re-imported torch and Lightning, 8 s of each test's 9 (2026-11-27). The collectives are the same.
STRATEGY = "ddp_fork"

TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


def calibrate(fabric, modelpool_yaml, out_dir, auto_select=None):
    algo = FeatCalAlgorithm(upstream=TA, num_calibration_examples=24, batch_size=4, auto_select=auto_select)
    algo._fabric_instance = fabric
    reports = []
    algo.save_report = lambda name, report: reports.append(report)  # every rank's, not rank 0's alone
    model = algo.run(instantiate(OmegaConf.load(modelpool_yaml)))
    rank = fabric.global_rank
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{out_dir}/rank{rank}.pt")
    if auto_select is not None:
        torch.save(reports[-1]["auto_select"], f"{out_dir}/auto{rank}.pt")


def assert_two_ranks_match_one(accelerator, strategy, modelpool_yaml, tmp_path, auto_select=None):
    """Calibrate on one device, then on two ranks: the ranks agree bit for bit and match the one within float
    rounding; returns the single run's and the ranks' state dicts."""
    single = tmp_path / "single"
    single.mkdir()
    calibrate(L.Fabric(accelerator=accelerator, devices=1), modelpool_yaml, single, auto_select)
    fabric = L.Fabric(accelerator=accelerator, devices=2, strategy=strategy)
    fabric.launch(calibrate, modelpool_yaml, str(tmp_path), auto_select)
    reference = torch.load(single / "rank0.pt")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, expected in reference.items():
        assert torch.equal(ranks[0][key], ranks[1][key]), f"ranks disagree on {key}"
        torch.testing.assert_close(ranks[0][key], expected, rtol=1e-4, atol=1e-5, msg=key)
    return reference, ranks


def test_two_gloo_ranks_match_one_process(toy_world, tmp_path):
    reference, ranks = assert_two_ranks_match_one("cpu", STRATEGY, toy_world["modelpool"], tmp_path)
    # and the runs calibrated something: every block's linear weights moved from the upstream merge by more than
    # the tolerance the ranks are held to
    upstream = instantiate(TA).run(instantiate(OmegaConf.load(toy_world["modelpool"]))).state_dict()
    moved = {key for key, value in upstream.items()
             if not torch.allclose(reference[key], value, rtol=1e-4, atol=1e-5)}
    linear = {key for key in upstream
              if ".encoder.layers." in key and key.endswith(("proj.weight", "fc1.weight", "fc2.weight"))}
    assert len(linear) == 2 * 6 and linear <= moved, sorted(linear - moved)


def test_two_gloo_ranks_choose_alpha_by_the_feature_site_as_one_process(toy_world, tmp_path):
    """alpha_criterion site on two ranks: each fit part shared out and its moments all-reduced, every held-out
    example scored on every rank; the ranks' choices, scores and models agree with each other bit for bit and
    with one process within float rounding."""
    auto_select = {"alpha_criterion": "site", "widen": False, "noise_z": 0.0,
                   "grid": {"lambda_": [1e-3], "rho": [2.0], "alpha": [0.6]}}
    assert_two_ranks_match_one("cpu", STRATEGY, toy_world["modelpool"], tmp_path, auto_select)
    single, ranks = torch.load(tmp_path / "single" / "auto0.pt"), [torch.load(tmp_path / f"auto{r}.pt") for r in (0, 1)]
    stages = [{k: v for k, v in r["alpha"].items() if k != "seconds"} for r in ranks]
    assert stages[0] == stages[1] and stages[0]["folds"] == 4 and stages[0]["calibrations"] == 8
    assert set(single["alpha"]["scores"]) == {"0.3", "0.6"} and ranks[0]["alpha"]["chosen"] == single["alpha"]["chosen"]
    for alpha, score in single["alpha"]["scores"].items():
        assert ranks[0]["alpha"]["scores"][alpha] == pytest.approx(score, rel=1e-5)


def calibrate_out_of_core(fabric, pool, out_dir):
    import types

    from test_out_of_core import ARGS, TA_BACKBONE

    # the pool's twelve examples per task: folds auto (eight parts of one or two) would leave a rank without a share
    # of a part, which is refused before any work (tests/test_selection.py); four parts of three
    algo = FeatCalAlgorithm(**{**ARGS, "num_calibration_examples": 12}, upstream=TA_BACKBONE, models_in_memory="none",
                            return_upstream=True, auto_select={"folds": 4,
                                                               "grid": {"lambda_": [1e-4, 1e-2, 1.0], "rho": [0.5, 2.0]}})
    algo._fabric_instance = fabric
    algo._program = types.SimpleNamespace(merged_model_save_path=str(out_dir), log_dir=None, _taskpool=None)
    assert algo.run(pool) is None  # no task pool: both models stay on disk


def test_two_gloo_ranks_out_of_core_with_auto_select_and_the_upstream_match_one_process(tmp_path):
    """Out of core on two ranks: each streams its shard, the moments (the held-out ones too) are all-reduced before
    every choice and solve, rank 0 writes the calibrated model and the upstream, the other waits at each block."""
    from safetensors.torch import load_file
    from test_out_of_core import llama_pool

    pool = llama_pool(tmp_path)
    calibrate_out_of_core(L.Fabric(accelerator="cpu", devices=1), pool, tmp_path / "single")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=STRATEGY)
    fabric.launch(calibrate_out_of_core, pool, tmp_path / "two")

    def tensors(folder):
        return {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}

    for suffix in ("", "_upstream"):
        single, two = tensors(tmp_path / f"single{suffix}"), tensors(tmp_path / f"two{suffix}")
        assert single.keys() == two.keys() and single
        for key, expected in single.items():
            torch.testing.assert_close(two[key], expected, rtol=1e-4, atol=1e-5, msg=key)
    upstream, calibrated = tensors(tmp_path / "two_upstream"), tensors(tmp_path / "two")
    assert not torch.equal(upstream["model.layers.1.mlp.down_proj.weight"],
                           calibrated["model.layers.1.mlp.down_proj.weight"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a partial folder was left"
