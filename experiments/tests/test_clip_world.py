"""A reduced build of the offline CLIP world, loaded and evaluated through FusionBench's pools."""

import copy
import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf

from featcal_experiments.worlds.clip_world import CLIP8, CLIP_QUICK, CLIPWorldSpec, TaskSpec, build_clip_world
from featcal_experiments.worlds.registry import ENV_DIR, compose_pools
from fusion_bench.utils import instantiate

import commands  # tests/commands.py (conftest.py)

pytestmark = pytest.mark.slow  # the tests build a world and run fusion_bench


REPO = Path(__file__).resolve().parents[2]

# The tasks of the packaged `offline_clip2` configs, so those configs serve this reduced world.
MINI = CLIPWorldSpec(
    name="clip",
    tasks=[TaskSpec("mnist", "mnist", 12, 4), TaskSpec("textile", "textile", 12, 4)],
    image_size=16, patch_size=8, width=32, layers=2, heads=2, text_width=32, text_layers=1, projection_dim=16,
    pretrain_steps=5, pretrain_batch=16, finetune_steps=3, finetune_batch=8,
)


def packaged_pools(subset):
    return compose_pools(f"CLIPVisionModelPool/{subset}", f"CLIPVisionModelTaskPool/{subset}")


@pytest.fixture(scope="module")
def mini_world(tmp_path_factory):
    """The reduced world, built where the registry looks for the world `clip` (under $FEATCAL_WORLDS_DIR)."""
    worlds = tmp_path_factory.mktemp("worlds")
    return worlds, build_clip_world(worlds / "clip", MINI)


def test_reduced_world_builds_and_is_served_by_the_packaged_fusion_bench_configs(mini_world, monkeypatch):
    worlds, paths = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    world = json.loads((worlds / "clip" / "world.json").read_text())
    assert world["counts"]["mnist"] == {"train": [12] * 10, "test": [4] * 10}
    assert set(world["figures"]["expert"]) == set(world["figures"]["others_only_task_arithmetic"]) == {"mnist", "textile"}
    assert 0.0 <= world["figures"]["linear_probe_task_identification"] <= 1.0

    modelpool_cfg, taskpool_cfg = packaged_pools("offline_clip2")
    pool = instantiate(modelpool_cfg)
    assert pool.model_names == ["mnist", "textile"] and pool.has_pretrained
    assert len(pool.load_train_dataset("mnist")) == 120
    # the world's own self-contained copy (absolute paths) names the same models
    assert instantiate(OmegaConf.load(paths["modelpool"])).model_names == pool.model_names
    taskpool = instantiate(taskpool_cfg)
    taskpool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    report = taskpool.evaluate(pool.load_model("mnist"))
    # The builder's own zero-shot evaluation and FusionBench's agree on the expert's accuracy.
    assert abs(report["mnist"]["accuracy"] - world["figures"]["expert"]["mnist"]) < 1e-6


def test_a_missing_world_fails_with_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    modelpool_cfg, _ = packaged_pools("offline_clip8")
    with pytest.raises(Exception, match="featcal-world build clip"):
        OmegaConf.to_container(modelpool_cfg, resolve=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("subset,size", [("offline_clip8", 8), ("offline_clip4", 4), ("offline_clip2", 2)])
def test_packaged_subsets_name_tasks_of_the_world(subset, size):
    modelpool_cfg, taskpool_cfg = packaged_pools(subset)
    tasks = list(taskpool_cfg.test_datasets)
    assert len(tasks) == size and set(tasks) <= set(CLIP8.task_names)
    assert list(modelpool_cfg.models) == ["_pretrained_", *tasks]
    assert list(modelpool_cfg.train_datasets) == list(modelpool_cfg.test_datasets) == tasks
    assert [t.name for t in CLIP8.tasks] == list(packaged_pools("offline_clip8")[1].test_datasets)


@pytest.mark.parametrize("pools", ["CLIPVisionModelPool", "OpenCLIPVisionModelPool"])
def test_the_quick_world_is_served_by_its_own_packaged_configs(pools, tmp_path, monkeypatch):
    """`clip-quick` (the quick start's world) is a separate registered world: its configs (HF and OpenCLIP) name its
    tasks and its folder, and fail with its own build command before it is built."""
    assert set(CLIP_QUICK.task_names) <= set(CLIP8.task_names) and CLIP_QUICK.name == "clip-quick"
    taskpools = pools.replace("ModelPool", "ModelTaskPool")
    modelpool_cfg, taskpool_cfg = compose_pools(f"{pools}/offline_clip_quick", f"{taskpools}/offline_clip_quick")
    for config in (modelpool_cfg, taskpool_cfg):
        assert "${featcal_world:clip}" not in OmegaConf.to_yaml(config)
        assert list(config.test_datasets) == CLIP_QUICK.task_names
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    with pytest.raises(Exception, match="featcal-world build clip-quick"):
        OmegaConf.to_container(modelpool_cfg, resolve=True)


def test_the_reproduction_runner_renders_table_12_from_real_fusion_bench_runs(mini_world, tmp_path, monkeypatch):
    """Table 12's pipeline end to end on the reduced world (its `offline_clip2` pools standing in for the eight
    tasks): Task Arithmetic once, calibrators per budget and seed after it, the table from their reports, and a second
    invocation that resumes instead of running again."""
    from dataclasses import replace

    from featcal_experiments.reproduce.catalog import OFFLINE_SETTINGS, Catalog
    from featcal_experiments.reproduce.render import build_table, markdown, write_tables
    from featcal_experiments.reproduce.runner import Runner, collect

    worlds, _ = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    catalog = Catalog("offline", tmp_path / "runs", ["probsurgery:method.precompute_features=true", "probsurgery:method.max_steps=5"])
    catalog.settings = {**OFFLINE_SETTINGS, "offline-clip8": replace(
        OFFLINE_SETTINGS["offline-clip8"], modelpool="CLIPVisionModelPool/offline_clip2",
        taskpool="CLIPVisionModelTaskPool/offline_clip2")}
    rows = catalog.select(["12"], ["ta+featcal/n8-seed4[23]", "ta+probsurgery/n8-seed42"])
    summary = Runner(catalog, log=lambda _: None).run(rows)
    assert summary.ok and summary.count("ran") == 4, summary.text()
    model = build_table(catalog, "12", collect(catalog, catalog.rows("12"))[0])
    by_method = {row.method: row for row in model.blocks[0].rows}
    featcal, probsurgery = by_method["ta+featcal"].cells["n8"], by_method["ta+probsurgery"].cells["n8"]
    assert featcal.seeds == 2 and 0.0 <= featcal.ours <= 100.0 and featcal.ours_std is not None
    assert probsurgery.seeds == 1 and by_method["ta+surgery"].status == "missing"
    assert by_method["ta+featcal"].budget_seconds["n8"] > 0
    assert "| w/ FeatCal (partial) | ours |" in markdown(model)
    assert (tmp_path / "table_12.png") in write_tables([model], tmp_path)
    # a second invocation resumes: the runs are reused, not repeated
    again = Runner(catalog, log=lambda _: None).run(rows)
    assert again.count("resumed") == 4 and again.count("ran") == 0


def test_ablation_reports_single_and_joint_recovery_interference_and_overlap(mini_world, tmp_path):
    worlds, _ = mini_world
    env = {**os.environ, ENV_DIR: str(worlds), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "ablation"
    command = [str(REPO / "experiments" / "scripts" / "world_ablation.py"), "--n", "8", "--out", str(out)]
    done = commands.run(*command, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    world = json.loads(out.with_suffix(".json").read_text())["worlds"]["clip"]
    assert [row["tasks"] for row in world["rows"]] == [["mnist"], ["textile"], ["mnist", "textile"]]
    pair = world["rows"][-1]
    assert pair["pair_interference"] is not None and set(pair["featcal"]) == {"mnist", "textile"}
    assert 0.0 <= world["overlap"]["mnist+textile"] <= 1.0 + 1e-9
    assert set(world["interference"]["mnist"]) == {"base", "base + others", "base + random, same norms", "base + own"}
    # the base row of the interference table is the same model as the references' zero-shot row
    assert world["interference"]["mnist"]["base"] == world["base"]["mnist"]
    assert "| mnist + textile | 2 |" in out.with_suffix(".md").read_text()


def test_interference_report_places_the_damage_and_agrees_with_the_builds_regime_figures(mini_world, tmp_path):
    worlds, _ = mini_world
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "interference"
    command = [
        str(REPO / "experiments" / "scripts" / "world_interference.py"), "--root", str(worlds / "clip"),
        "--n-train", "8", "--out", str(out),
    ]
    done = commands.run(*command, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    meta = json.loads((worlds / "clip" / "world.json").read_text())
    figures = meta["figures"]
    per_task = results["per_task"]
    assert set(per_task) == {"mnist", "textile"}
    for task, row in per_task.items():
        # Computed here from the saved models and data in float64; the build computed them in float32 from its
        # models in memory. A logit tie broken the other way may move one test image, no more.
        one_image = 100 / sum(meta["counts"][task]["test"])
        assert abs(row["base"] - 100 * figures["zero_shot"][task]) <= one_image + 1e-6
        assert abs(row["base + others"] - 100 * figures["others_only_task_arithmetic"][task]) <= one_image + 1e-6
    groups = [k.removeprefix("others only in ") for k in per_task["mnist"] if k.startswith("others only in ")]
    blocks = ["block 0 attention", "block 0 MLP", "block 1 attention", "block 1 MLP"]
    assert groups == ["embeddings", *blocks, "layer norms"]
    assert list(results["relative_step_percent"]) == groups
    assert all(v >= 0 for v in results["relative_step_percent"].values())
    assert "sha1" in results["world"] and "| base + others |" in out.with_suffix(".md").read_text()


def test_interference_affine_fit_recovers_a_known_map_and_groups_split_a_clip_tower():
    sys.path.insert(0, str(REPO / "experiments" / "scripts"))
    import torch
    import world_interference as wi
    from transformers import CLIPVisionConfig, CLIPVisionModel

    generator = torch.Generator().manual_seed(0)
    source = torch.randn(64, 5, generator=generator, dtype=torch.float64)
    weight = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    bias = torch.randn(3, generator=generator, dtype=torch.float64)
    fitted = wi.affine_fit(source, source @ weight + bias)
    torch.testing.assert_close(fitted, torch.cat([weight, bias[None]]))  # built independently: [W; b]
    probe = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(wi.apply_affine(probe, fitted), probe @ weight + bias)

    tower = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=16, patch_size=8,
    ))
    keys = list(tower.state_dict())
    groups = wi.parameter_groups(keys)
    blocks = [f"block {i} {part}" for i in range(3) for part in ("attention", "MLP")]
    assert list(groups) == ["embeddings", *blocks, "layer norms"]
    assert sorted(k for k in keys if any(f(k) for f in groups.values())) == sorted(keys)
    with pytest.raises(ValueError, match="exactly one group"):
        wi.parameter_groups(keys + ["vision_model.extra.weight"])


def test_multitask_report_trains_one_tower_on_every_task_beside_the_builds_regime_figures(mini_world, tmp_path):
    worlds, _ = mini_world
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "multitask"
    command = [str(REPO / "experiments" / "scripts" / "world_multitask.py"), "--root", str(worlds / "clip"),
               "--steps-per-task", "2", "--out", str(out)]
    done = commands.run(*command, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    world = json.loads((worlds / "clip" / "world.json").read_text())["figures"]
    assert result["recipe"]["steps"] == 4 and result["recipe"]["lr"] == MINI.finetune_lr
    rows = result["rows"]
    assert rows["Individual experts (world.json)"]["mnist"] == pytest.approx(100 * world["expert"]["mnist"])
    assert all(0.0 <= v <= 100.0 for v in rows["Multi-task learning (one tower)"].values())
    report = out.with_suffix(".md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| model |"))
    assert header.split(" | ")[1:] == [*world["expert"], "average |"]
    assert "| Multi-task learning (one tower) |" in report and "cycling through the 2 tasks" in report


def test_multitask_training_draws_step_s_from_task_s_mod_n():
    import torch

    from featcal_experiments.worlds.clip_common import train_vision_tower
    from transformers import CLIPConfig, CLIPModel

    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 8}
    text = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    head = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)
    labels = torch.tensor([0, 1, 0, 1])
    clean, poisoned = torch.randn(4, 3, 16, 16), torch.full((4, 3, 16, 16), float("nan"))
    tasks = [(head, clean, labels), (head, poisoned, labels)]
    for steps, finite in ((1, True), (2, False)):  # the second step is the first to read the second task
        tower = CLIPModel(clip.config).vision_model
        train_vision_tower(clip, tower, tasks, steps, 2, 1e-3, torch.Generator().manual_seed(0))
        assert all(torch.isfinite(p).all() for p in tower.parameters()) == finite


def test_the_alpha_probe_scores_the_very_copy_its_criteria_read_with_test_fit(mini_world, monkeypatch):
    """``alpha-probe --test-fit``: each alpha's test score is that of the copy calibrated on the fit part (the one the
    held-out criteria read), recomputed here with the engine on the fit part alone, and not of a calibration on all
    examples; the criteria are unchanged."""
    from dataclasses import replace

    import torch

    from featcal_experiments.autoselect_lab import Lab, alpha_probe
    from featcal_fusionbench.autoselect.options import SelectionOptions
    from featcal_fusionbench.autoselect.search import split_datasets
    from featcal_fusionbench.engine.loop import FeatCalEngine

    worlds, _ = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    lab = Lab(["method=featcal/clip_ta", "modelpool=CLIPVisionModelPool/offline_clip2",
               "taskpool=CLIPVisionModelTaskPool/offline_clip2"])
    scored = []
    evaluate = lab.evaluate
    lab.evaluate = lambda model, **kw: scored.append(copy.deepcopy(model.state_dict())) or evaluate(model, **kw)
    alphas, hparams = [0.3, 1.0], {"lambda_": 1e-4, "rho": 2.0}
    rows = alpha_probe(lab, 8, 42, alphas, test=False, test_fit=True, **hparams)
    assert len(scored) == len(alphas)
    plain = alpha_probe(lab, 8, 42, alphas, test=False, **hparams)
    assert len(scored) == len(alphas)  # without --test-fit (and --no-test) nothing is scored on the test sets
    algorithm, datasets, base, experts, family, merged = lab.prepare(8, 42)
    hp = replace(algorithm.featcal_hparams, **hparams)
    fit, _, _ = split_datasets(datasets, SelectionOptions(), hp.seed)

    def calibrated(data, alpha):
        model = copy.deepcopy(merged)
        FeatCalEngine(family, replace(hp, alpha=alpha), lab.fabric.device, progress=False).run(
            model, base, experts, {t: list(family.batches(lab.modelpool, d, hp.batch_size)) for t, d in data.items()})
        return model

    for row, other, alpha, state in zip(rows, plain, alphas, scored):
        assert "test" not in row and "test_fit" not in other
        assert {k: v for k, v in row.items() if not k.startswith("test_fit")} == other
        fit_model, full_model = calibrated(fit, alpha), calibrated(datasets, alpha)
        assert all(torch.equal(state[k], v) for k, v in fit_model.state_dict().items())
        assert not all(torch.equal(state[k], v) for k, v in full_model.state_dict().items())
        assert row["test_fit_per_task"] == evaluate(fit_model)
