"""A reduced build of the offline CLIP world, loaded and evaluated through FusionBench's pools."""

import json

import lightning as L
from omegaconf import OmegaConf

from featcal_fusionbench.worlds.clip_world import CLIPWorldSpec, TaskSpec, build_clip_world
from fusion_bench.utils import instantiate

MINI = CLIPWorldSpec(
    name="mini",
    tasks=[TaskSpec("mnist", "mnist", 12, 4), TaskSpec("textile", "textile", 12, 4)],
    image_size=16, patch_size=8, width=32, layers=2, heads=2, text_width=32, text_layers=1, projection_dim=16,
    pretrain_steps=5, pretrain_batch=16, finetune_steps=3, finetune_batch=8,
)


def test_reduced_world_builds_and_is_served_by_fusion_bench(tmp_path):
    paths = build_clip_world(tmp_path, MINI)
    world = json.loads((tmp_path / "world.json").read_text())
    assert world["counts"]["mnist"] == {"train": [12] * 10, "test": [4] * 10}
    assert set(world["figures"]["expert"]) == {"mnist", "textile"}
    assert 0.0 <= world["figures"]["linear_probe_task_identification"] <= 1.0

    pool = instantiate(OmegaConf.load(paths["modelpool"]))
    assert pool.model_names == ["mnist", "textile"] and pool.has_pretrained
    assert len(pool.load_train_dataset("mnist")) == 120
    taskpool = instantiate(OmegaConf.load(paths["taskpool"]))
    taskpool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    report = taskpool.evaluate(pool.load_model("mnist"))
    # The builder's own zero-shot evaluation and FusionBench's agree on the expert's accuracy.
    assert abs(report["mnist"]["accuracy"] - world["figures"]["expert"]["mnist"]) < 1e-6
