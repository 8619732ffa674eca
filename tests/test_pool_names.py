"""The paper's pools by their short names (`modelpool=clip-vit-base-patch32_TA8`): each composes to exactly the pool
its long name does, and a run that would evaluate nothing on one of them is warned with the task pool to add."""

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from featcal_fusionbench.integration.pool_names import (
    PAPER_POOLS,
    config_text,
    taskpool_hint,
    warn_if_nothing_is_evaluated,
)

import commands

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def composer():
    import fusion_bench_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        yield lambda *overrides, **kw: compose("fabric_model_fusion", overrides=list(overrides), **kw)
    GlobalHydra.instance().clear()


def test_every_short_name_has_its_config_and_no_config_is_unlisted():
    folder = REPO / "config" / "modelpool"
    assert sorted(p.stem for p in folder.glob("*.yaml")) == sorted(PAPER_POOLS)
    for short in PAPER_POOLS:
        assert (folder / f"{short}.yaml").read_text() == config_text(short)
    # the pools of the paper's Tables 1-3 and App. I: B/32, B/16 and L/14 on 8, 14 and 20 tasks, FLAN-T5 on GLUE
    assert {f"clip-vit-{a}_{s}" for a in ("base-patch32", "base-patch16", "large-patch14")
            for s in ("TA8", "TALL14", "TALL20")} | {"flan-t5-base_glue", "flan-t5-large_glue_lora16"} == set(PAPER_POOLS)


@pytest.mark.parametrize("short", sorted(PAPER_POOLS))
def test_a_short_name_composes_to_the_same_pool_as_its_long_name_and_its_task_pool_composes(composer, short):
    pool = PAPER_POOLS[short]
    via_short = composer("method=featcal", f"modelpool={short}")
    via_long = composer("method=featcal", f"modelpool={pool.modelpool}")
    assert OmegaConf.to_container(via_short) == OmegaConf.to_container(via_long)
    assert via_short.modelpool._target_.startswith("fusion_bench.modelpool.")
    evaluated = composer("method=featcal", f"modelpool={short}", *pool.taskpool_args.split())
    assert set(evaluated.taskpool.test_datasets) == {m for m in via_long.modelpool.models if m != "_pretrained_"}


@pytest.mark.slow
@pytest.mark.parametrize("short", ["clip-vit-base-patch32_TA8", "flan-t5-large_glue_lora16"])
def test_the_cli_composes_a_short_name_as_its_long_name(tmp_path, short):
    def job(modelpool):
        done = commands.run("fusion_bench", "--cfg", "job", "method=featcal", f"modelpool={modelpool}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return OmegaConf.create(done.stdout)

    assert job(short) == job(PAPER_POOLS[short].modelpool)


def test_the_task_pool_hint_names_what_to_add_only_when_nothing_would_be_evaluated():
    assert taskpool_hint({"modelpool": "clip-vit-base-patch32_TA8", "taskpool": "dummy"}) == \
        "taskpool=CLIPVisionModelTaskPool/clip-vit-classification_TA8"
    assert taskpool_hint({"modelpool": "CLIPVisionModelPool/clip-vit-large-patch14_TALL20", "taskpool": "dummy"}) == \
        "taskpool=CLIPVisionModelTaskPool/clip-vit-classification_TALL20 taskpool.base_model=openai/clip-vit-large-patch14"
    assert taskpool_hint({"modelpool": "clip-vit-base-patch32_TA8",
                          "taskpool": "CLIPVisionModelTaskPool/clip-vit-classification_TA8"}) is None
    assert taskpool_hint({"modelpool": "CLIPVisionModelPool/offline_clip8", "taskpool": "dummy"}) is None


def test_a_run_on_a_short_name_without_a_task_pool_is_warned_at_its_start(composer, caplog):
    assert warn_if_nothing_is_evaluated() is None  # outside Hydra: nothing to say
    cfg = composer("method=featcal", "modelpool=flan-t5-base_glue", return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        with caplog.at_level(logging.WARNING):
            hint = warn_if_nothing_is_evaluated()
    finally:
        HydraConfig.instance().cfg = None
    assert hint == "taskpool=flan-t5_glue_text_generation_average"
    assert "modelpool=flan-t5-base_glue with FusionBench's default task pool evaluates nothing" in caplog.text
    assert hint in caplog.text
