"""An offline CLIP world served through FusionBench's OpenCLIP pool and task pool (``worlds/openclip_serving.py``):
the packaged ``OpenCLIPVisionModelPool/offline_clip_quick`` configs serve the network that the HF configs serve, so
evaluation, Task Arithmetic and FeatCal give the same numbers through either pool. A reduced build of the quick
world (its four tasks, tiny sizes) stands in for it."""

import json
import os

import lightning as L
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from featcal_fusionbench.models.openclip_convert import openclip_to_hf_state
from featcal_experiments.worlds.clip_world import CLIP_QUICK, CLIPWorldSpec, TaskSpec, build_clip_world
from featcal_experiments.worlds.registry import ENV_DIR, compose_pools, fusion_bench_args
from featcal_fusionbench import FeatCalAlgorithm, ProbSurgeryAlgorithm, SurgeryAlgorithm
from featcal_fusionbench.families.openclip_vision import vision_tower
from fusion_bench.method import TaskArithmeticAlgorithm
from fusion_bench.utils import instantiate

import commands  # tests/commands.py

pytestmark = pytest.mark.slow  # the tests build a world and run both pools

MINI_QUICK = CLIPWorldSpec(
    name="clip-quick",
    tasks=[TaskSpec(t.name, t.source, 6, 5) for t in CLIP_QUICK.tasks],
    image_size=16, patch_size=8, width=32, layers=2, heads=2, text_width=32, text_layers=1, projection_dim=16,
    pretrain_steps=5, pretrain_batch=16, finetune_steps=20, finetune_batch=8, finetune_lr=1e-3,
)
POOLS = {"hf": ("CLIPVisionModelPool/offline_clip_quick", "CLIPVisionModelTaskPool/offline_clip_quick"),
         "openclip": ("OpenCLIPVisionModelPool/offline_clip_quick", "OpenCLIPVisionModelTaskPool/offline_clip_quick")}
TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


@pytest.fixture(scope="module")
def quick_world(tmp_path_factory):
    """The reduced quick world where the registry looks for `clip-quick` ($FEATCAL_WORLDS_DIR, for this module)."""
    worlds = tmp_path_factory.mktemp("worlds")
    build_clip_world(worlds / "clip-quick", MINI_QUICK)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_DIR, str(worlds))
        yield worlds


def pools(kind):
    modelpool_cfg, taskpool_cfg = compose_pools(*POOLS[kind])
    return instantiate(modelpool_cfg), taskpool_cfg


def evaluate(kind, model):
    modelpool, taskpool_cfg = pools(kind)
    taskpool = instantiate(taskpool_cfg)
    taskpool._program = type("Program", (), {"modelpool": modelpool})()  # the OpenCLIP task pool reads its transform
    taskpool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    report = taskpool.evaluate(model)
    return {t: report[t]["accuracy"] for t in CLIP_QUICK.task_names}


def assert_same_scores(got, expected):
    """Equal accuracies, up to one test image per task whose prediction float rounding may flip."""
    modelpool, _ = pools("hf")
    for task, value in expected.items():
        assert abs(got[task] - value) <= 1 / len(modelpool.load_test_dataset(task)) + 1e-9, (task, got[task], value)


def test_the_openclip_pool_serves_the_same_network_with_the_same_transform(quick_world):
    hf_pool, _ = pools("hf")
    oc_pool, _ = pools("openclip")
    assert oc_pool.model_names == hf_pool.model_names == CLIP_QUICK.task_names
    assert list(oc_pool._classification_heads) == CLIP_QUICK.task_names
    images = [hf_pool.load_test_dataset("mnist")[i]["image"] for i in range(4)]
    hf_pixels = hf_pool.load_processor()(images=images, return_tensors="pt")["pixel_values"]
    oc_pixels = torch.stack([oc_pool.test_processor(image) for image in images])
    torch.testing.assert_close(oc_pixels, hf_pixels, rtol=0, atol=1e-5)
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(quick_world / "clip-quick" / "pretrained")
    with torch.no_grad():
        expected = clip.visual_projection(hf_pool.load_model("mnist")(pixel_values=hf_pixels).pooler_output)
        torch.testing.assert_close(oc_pool.load_model("mnist")(hf_pixels), expected, rtol=1e-4, atol=1e-5)


def test_zero_shot_and_experts_score_alike_through_both_pools_and_as_the_build_measured(quick_world):
    figures = json.loads((quick_world / "clip-quick" / "world.json").read_text())["figures"]
    for kind in POOLS:
        modelpool, _ = pools(kind)
        assert_same_scores(evaluate(kind, modelpool.load_pretrained_model()), figures["zero_shot"])
        assert_same_scores({t: evaluate(kind, modelpool.load_model(t))[t] for t in CLIP_QUICK.task_names},
                           figures["expert"])


def test_task_arithmetic_and_featcal_agree_through_both_pools(quick_world):
    """FeatCal's calibrated parameters, through the HF pool (clip_vision) and the OpenCLIP pool (openclip_vision),
    mapped back to HF names: equal within float tolerance, and both score alike."""
    merged, calibrated, scores = {}, {}, {}
    for kind in POOLS:
        modelpool, _ = pools(kind)
        merged[kind] = TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(modelpool)
        algo = FeatCalAlgorithm(upstream=TA, num_calibration_examples=8, batch_size=8)
        algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
        calibrated[kind] = algo.run(pools(kind)[0])
        scores[kind] = {m: evaluate(kind, model) for m, model in (("ta", merged[kind]), ("featcal", calibrated[kind]))}
    for method in ("ta", "featcal"):
        assert_same_scores(scores["openclip"][method], scores["hf"][method])
    oc_state = openclip_to_hf_state(vision_tower(calibrated["openclip"]))
    hf_state, before = calibrated["hf"].state_dict(), merged["hf"].state_dict()
    moved = 0
    for key, value in oc_state.items():
        torch.testing.assert_close(value, hf_state[key], rtol=1e-4, atol=2e-5, msg=key)
        moved += not torch.allclose(hf_state[key], before[key], rtol=1e-4, atol=1e-4)
    assert moved >= 2 * 10  # both blocks' linears and norms moved


@pytest.mark.parametrize("cls", [SurgeryAlgorithm, ProbSurgeryAlgorithm], ids=lambda c: c.__name__)
def test_surgery_with_normalized_features_trains_the_same_maps_through_both_pools(cls, quick_world):
    """With `family_options.surgery_feature=normalized`, the OpenCLIP maps read the unit-normalised feature, as
    FusionBench's HF CLIP protocol does: at one seed both pools train the same maps (the pools' pixels agree to
    float rounding, not bit for bit) and score alike. The default, the encoder's raw output (Surgery's original
    code on the task-vector checkpoints), trains other maps."""
    maps, scores = {}, {}
    for kind, options in (("hf", {}), ("openclip", {"surgery_feature": "normalized"}),
                          ("openclip_raw", {})):
        algo = cls(upstream=TA, num_calibration_examples=8, batch_size=8, max_steps=15, family_options=options,
                   precompute_features=True)
        algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
        pool_kind = "hf" if kind == "hf" else "openclip"
        deployed = algo.run(pools(pool_kind)[0])
        maps[kind] = [p.detach() for p in deployed.collect_trainable_params()]  # per task, in task order
        scores[kind] = evaluate(pool_kind, deployed)
    assert len(maps["hf"]) == len(maps["openclip"]) >= 2 * len(CLIP_QUICK.task_names)
    for ours, theirs in zip(maps["openclip"], maps["hf"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)
    assert any(not torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(maps["openclip_raw"], maps["hf"]))
    assert_same_scores(scores["openclip"], scores["hf"])


def test_a_surgery_feature_the_family_does_not_know_fails_at_construction_or_before_the_merge(quick_world):
    with pytest.raises(ValueError, match="not an option of any model family"):
        SurgeryAlgorithm(family_options={"surgery_features": "normalized"})
    algo = SurgeryAlgorithm(upstream=TA, num_calibration_examples=8, family_options={"surgery_feature": "unit"})
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="surgery_feature must be one of"):
        algo.run(pools("openclip")[0])


def test_featcal_runs_through_the_cli_on_the_openclip_pool_from_the_arguments_featcal_world_prints(quick_world, tmp_path):
    args = fusion_bench_args("clip-quick", openclip=True)
    assert args == ["modelpool=OpenCLIPVisionModelPool/offline_clip_quick",
                    "taskpool=OpenCLIPVisionModelTaskPool/offline_clip_quick"]
    done = commands.run("fusion_bench", "method=featcal/openclip_ta", "method.num_calibration_examples=8",
                        "method.return_upstream=true", *args, f"path.log_dir={tmp_path}", cwd=tmp_path,
                        env={**os.environ, ENV_DIR: str(quick_world)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(next(tmp_path.rglob("program_report.json")).read_text())
    for model in ("upstream", "featcal"):
        accuracies = [report[model][t]["accuracy"] for t in CLIP_QUICK.task_names]
        assert all(0.0 <= a <= 1.0 for a in accuracies) and np.isfinite(accuracies).all()


def test_featcal_world_args_names_the_worlds_without_openclip_pools(capsys):
    from featcal_experiments.worlds.cli import main

    assert main(["args", "t5", "--openclip"]) == 2
    assert "no OpenCLIP pools" in capsys.readouterr().err
    with pytest.raises(KeyError, match="clip-quick"):
        fusion_bench_args("llm", openclip=True)


def test_the_eight_task_openclip_configs_serve_the_hf_configs_tasks():
    hf_modelpool, hf_taskpool = compose_pools("CLIPVisionModelPool/offline_clip8", "CLIPVisionModelTaskPool/offline_clip8")
    modelpool, taskpool = compose_pools("OpenCLIPVisionModelPool/offline_clip8", "OpenCLIPVisionModelTaskPool/offline_clip8")
    tasks = list(hf_taskpool.test_datasets)
    assert list(modelpool.models) == list(hf_modelpool.models)
    assert list(modelpool.classification_heads) == list(taskpool.classification_heads) == tasks
    for split in ("train_datasets", "test_datasets"):
        assert OmegaConf.to_container(modelpool[split]) == OmegaConf.to_container(hf_modelpool[split])
    models, hf_models = (OmegaConf.to_container(pool.models, resolve=False) for pool in (modelpool, hf_modelpool))
    for name, path in hf_models.items():
        assert models[name]["checkpoint"] == path and models[name]["clip"] == hf_models["_pretrained_"]
