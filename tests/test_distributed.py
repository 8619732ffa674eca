"""Two CPU processes (gloo) give the single-process result: shards plus all-reduced moments."""

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from featcal_fusionbench import FeatCalAlgorithm
from fusion_bench.utils import instantiate

pytestmark = pytest.mark.slow  # two gloo ranks in processes of their own

TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


def calibrate(fabric, modelpool_yaml, out_dir):
    algo = FeatCalAlgorithm(upstream=TA, num_calibration_examples=24, batch_size=4)
    algo._fabric_instance = fabric
    model = algo.run(instantiate(OmegaConf.load(modelpool_yaml)))
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{out_dir}/rank{fabric.global_rank}.pt")


def test_two_gloo_ranks_match_one_process(toy_world, tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    calibrate(L.Fabric(accelerator="cpu", devices=1), toy_world["modelpool"], single)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
    fabric.launch(calibrate, toy_world["modelpool"], str(tmp_path))

    reference = torch.load(single / "rank0.pt")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, expected in reference.items():
        assert torch.equal(ranks[0][key], ranks[1][key]), f"ranks disagree on {key}"
        torch.testing.assert_close(ranks[0][key], expected, rtol=1e-4, atol=1e-5, msg=key)
    # and the runs calibrated something: every block's linear weights moved from the upstream merge by more than
    # the tolerance the ranks are held to
    upstream = instantiate(TA).run(instantiate(OmegaConf.load(toy_world["modelpool"]))).state_dict()
    moved = {key for key, value in upstream.items()
             if not torch.allclose(reference[key], value, rtol=1e-4, atol=1e-5)}
    linear = {key for key in upstream
              if ".encoder.layers." in key and key.endswith(("proj.weight", "fc1.weight", "fc2.weight"))}
    assert len(linear) == 2 * 6 and linear <= moved, sorted(linear - moved)
