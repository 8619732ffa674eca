"""A reduced build of the offline text world (`featcal-world build t5`), served by the packaged FusionBench configs."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from datasets import load_from_disk
from omegaconf import OmegaConf

from featcal_experiments.worlds import text_sources
from featcal_experiments.worlds.cli import main as world_cli
from featcal_experiments.worlds.registry import ENV_DIR, WORLDS, compose_pools
from featcal_experiments.worlds.t5_world import (
    T5_WORLD, T5WorldSpec, build_t5_world, expert_matrix_table, regime_table, score, span_corruption,
)
from featcal_experiments.worlds.text_sources import TaskSizes
from fusion_bench.utils import instantiate

pytestmark = pytest.mark.slow  # the tests build a reduced text world


REPO = Path(__file__).resolve().parents[2]

# Two of the world's tasks, one scored by accuracy and one by Spearman's rho; a few examples and steps.
MINI = T5WorldSpec(
    tasks=["language", "wordcount"],
    sizes={"language": TaskSizes(2, 6), "wordcount": TaskSizes(2, 6)},
    d_model=32, d_kv=16, num_heads=2, d_ff=64, num_layers=1, num_decoder_layers=1,
    pretrain_steps=4, pretrain_batch=8, finetune_steps=3, finetune_batch=8,
)


def packaged_pools():
    return compose_pools(WORLDS["t5"].modelpool, WORLDS["t5"].taskpool)


@pytest.fixture(scope="module")
def mini_world(tmp_path_factory):
    worlds = tmp_path_factory.mktemp("worlds")
    return worlds, build_t5_world(worlds / "t5", MINI)


def test_reduced_world_is_in_fusion_bench_flan_t5_format(mini_world):
    worlds, meta = mini_world
    root = worlds / "t5"
    assert json.loads((root / "world.json").read_text()) == json.loads(json.dumps(meta))
    assert meta["tasks"] == ["language", "wordcount"] and meta["regression_tasks"] == ["wordcount"]
    assert meta["counts"]["language"]["test"] == {label: 2 for label in text_sources.LANGUAGES}
    assert set(meta["figures"]["expert_matrix"]["language"]) == {"language", "wordcount"}
    assert all(0 < v < 0.05 for v in meta["figures"]["relative_task_vector_norm"].values())
    for task in meta["tasks"]:
        for split in ("train", "test"):
            data = load_from_disk(str(root / "data" / task / split))
            assert data.column_names == ["input_ids", "attention_mask", "labels"]
            row = data[0]
            assert len(row["input_ids"]) == len(row["attention_mask"]) == len(data[-1]["input_ids"])
            n = sum(row["attention_mask"])
            assert row["input_ids"][n - 1] == 1 and set(row["input_ids"][n:]) <= {0}  # EOS, then pad 0
            labels = [t for t in row["labels"] if t != -100]
            assert labels[-1] == 1 and row["labels"][: len(labels)] == labels  # EOS, then -100
    table = regime_table(meta).splitlines()
    assert table[0] == "| model | language | wordcount (rho) | average |"
    expert_row = next(line for line in table if line.startswith("| experts"))
    assert f"{100 * meta['figures']['expert']['language']:.1f}" in expert_row
    assert len(expert_matrix_table(meta).splitlines()) == 2 + len(meta["tasks"])
    config = json.loads((root / "pretrained" / "config.json").read_text())
    assert (config["feed_forward_proj"], config["tie_word_embeddings"], config["vocab_size"]) == ("gated-gelu", False, 384)
    assert (config["decoder_start_token_id"], config["pad_token_id"], config["eos_token_id"]) == (0, 0, 1)


def test_packaged_configs_serve_the_reduced_world(mini_world, monkeypatch):
    worlds, meta = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    modelpool_cfg, taskpool_cfg = packaged_pools()
    pool = instantiate(modelpool_cfg)
    assert pool.model_names == T5_WORLD.tasks and pool.has_pretrained
    base = pool.load_pretrained_model()
    expert = pool.load_model("language")
    assert type(expert).__name__ == "T5ForConditionalGeneration"
    delta = sum(float((a - b).norm() ** 2) for a, b in zip(expert.state_dict().values(), base.state_dict().values()))
    assert delta > 0
    assert len(pool.load_train_dataset("language")) == 6 * len(text_sources.LANGUAGES)
    tokenizer = instantiate(modelpool_cfg.tokenizer)
    assert tokenizer("german")["input_ids"] == [b + 3 for b in b"german"] + [1]
    # FusionBench's own scoring of the expert, through the pool's dataset, agrees with the builder's figure.
    test_set = pool.load_test_dataset("language")
    assert score(expert, test_set, tokenizer, False, 16) == pytest.approx(meta["figures"]["expert"]["language"])

    taskpool = OmegaConf.to_container(taskpool_cfg, resolve=True)
    assert taskpool["regression_tasks"] == ["wordcount"] and list(taskpool["test_datasets"]) == T5_WORLD.tasks
    assert taskpool["tokenizer"] == str(worlds / "t5" / "pretrained")


def test_text_taskpool_reports_an_average(mini_world, monkeypatch):
    worlds, meta = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    import lightning as L

    modelpool_cfg, taskpool_cfg = packaged_pools()
    config = OmegaConf.to_container(taskpool_cfg, resolve=True)
    config["test_datasets"] = {t: d for t, d in config["test_datasets"].items() if t in meta["tasks"]}  # the built ones
    taskpool = instantiate(OmegaConf.create(config))
    taskpool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    report = taskpool.evaluate(instantiate(modelpool_cfg).load_model("language"))
    assert "average" in report and "spearman_rho" in report["wordcount"]
    assert report["language"]["accuracy"] == pytest.approx(meta["figures"]["expert"]["language"])


def test_a_missing_world_fails_with_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    modelpool_cfg, _ = packaged_pools()
    with pytest.raises(Exception, match="featcal-world build t5"):
        OmegaConf.to_container(modelpool_cfg, resolve=True)
    assert list(tmp_path.iterdir()) == []


def test_cli_knows_the_world(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert world_cli(["list"]) == 0 and "t5" in capsys.readouterr().out
    assert world_cli(["args", "t5"]) == 1


def test_packaged_configs_name_the_world_tasks():
    modelpool = yaml.safe_load((REPO / "experiments/config/modelpool/Seq2SeqLMPool/offline_t5.yaml").read_text())
    taskpool = yaml.safe_load((REPO / "experiments/config/taskpool/offline_t5_text_generation.yaml").read_text())
    assert list(modelpool["models"]) == ["_pretrained_", *T5_WORLD.tasks]
    assert list(modelpool["train_datasets"]) == list(modelpool["test_datasets"]) == T5_WORLD.tasks
    assert list(taskpool["test_datasets"]) == T5_WORLD.tasks and taskpool["max_length"] == T5_WORLD.max_length


def test_full_task_splits_are_balanced_disjoint_and_held_out_of_pretraining():
    tasks = text_sources.build_tasks(T5_WORLD.tasks, T5_WORLD.sizes, T5_WORLD.seed)
    assert len(tasks) >= 5 and [n for n, t in tasks.items() if t.regression] == text_sources.REGRESSION_TASKS
    train_texts = {text for t in tasks.values() for text, _ in t.train}
    for name, task in tasks.items():
        counts = task.counts()["test"]
        assert len(set(counts.values())) == 1 and 300 <= len(task.test) <= 500, (name, counts)
        assert not train_texts & {text for text, _ in task.test}
        # answers fit FusionBench's generate(max_length=10): the decoder start token, at most 9 bytes
        assert max(len(y.encode("utf-8")) for y in task.targets("train") + task.targets("test")) <= 9
        assert len({text for text, _ in task.train}) == len(task.train)
    held_out = text_sources.held_out_entries(tasks.values())
    corpus = set(text_sources.pretraining_corpus(held_out, 0))
    assert len(corpus) > 50_000 and not corpus & held_out
    again = text_sources.build_tasks(["form"], T5_WORLD.sizes, T5_WORLD.seed)["form"]
    assert again.test == tasks["form"].test  # seeded; its train split differs only by the other tasks' held-out entries


def test_span_corruption_is_t5_shaped():
    import numpy as np

    ids = list(range(10, 110))
    sentinels = [259 + i for i in range(20)]
    inputs, targets = span_corruption(ids, sentinels, 1, 0.15, 4.0, np.random.default_rng(0))
    assert inputs[-1] == targets[-1] == 1 and targets[0] == 259
    # every byte is either kept in the input or restored by the target, in order
    merged = []
    spans = {}
    current = None
    for t in targets[:-1]:
        if t in sentinels:
            current = t
            spans[t] = []
        else:
            spans[current].append(t)
    for t in inputs[:-1]:
        merged += spans[t] if t in sentinels else [t]
    assert merged == ids and 10 <= sum(len(v) for v in spans.values()) <= 20
    assert torch.equal(torch.tensor(inputs), torch.tensor(span_corruption(ids, sentinels, 1, 0.15, 4.0, np.random.default_rng(0))[0]))
