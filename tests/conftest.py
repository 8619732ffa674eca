import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """A toy CLIP world on disk (two tasks), with FusionBench pool and task-pool YAMLs."""
    from featcal_experiments.worlds.toy_clip import ToyCLIPSpec, build_toy_clip_world

    root = tmp_path_factory.mktemp("toy_world")
    paths = build_toy_clip_world(root, ToyCLIPSpec(num_tasks=2))
    return {"root": root, **paths}


@pytest.fixture(scope="session")
def tiny_t5_pool(tmp_path_factory):
    """Two tiny T5 experts on disk with ByT5-tokenized train/test splits and pool / task-pool YAMLs."""
    import yaml
    from datasets import Dataset
    from transformers import ByT5Tokenizer

    from helpers import perturbed, tiny_t5

    root = tmp_path_factory.mktemp("tiny_t5")
    tokenizer = ByT5Tokenizer()
    base = tiny_t5(layers=2, d_model=32, vocab=len(tokenizer))
    base.save_pretrained(root / "pretrained")
    tokenizer.save_pretrained(root / "pretrained")
    words = {"colour": ["red", "blue"], "size": ["big", "small"]}
    def model(path):
        return {"_target_": "transformers.AutoModelForSeq2SeqLM.from_pretrained", "pretrained_model_name_or_path": str(path)}

    pool = {"models": {"_pretrained_": model(root / "pretrained")}, "train_datasets": {}, "test_datasets": {}}
    for i, (task, labels) in enumerate(words.items()):
        perturbed(base, 0.05, 10 + i).save_pretrained(root / "experts" / task)
        pool["models"][task] = model(root / "experts" / task)
        for split, count in (("train", 24), ("test", 8)):
            prompts = [f"{task}? item {k} {'x' * (k % 7)}" for k in range(count)]
            targets = [labels[k % 2] for k in range(count)]
            encoded = tokenizer(prompts, padding="max_length", max_length=40, truncation=True)
            label_ids = tokenizer(targets, padding="max_length", max_length=8)["input_ids"]
            encoded["labels"] = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in label_ids]
            path = root / "data" / task / split
            Dataset.from_dict(dict(encoded)).save_to_disk(str(path))
            pool[f"{split}_datasets"][task] = {"_target_": "datasets.load_from_disk", "dataset_path": str(path)}
    tokenizer_cfg = {"_target_": "transformers.AutoTokenizer.from_pretrained", "pretrained_model_name_or_path": str(root / "pretrained")}
    modelpool = {"_target_": "fusion_bench.modelpool.Seq2SeqLMPool", "_recursive_": False, "tokenizer": tokenizer_cfg, **pool}
    taskpool = {
        "_target_": "featcal_fusionbench.text_taskpool.TextGenerationTaskPool", "_recursive_": False,
        "test_datasets": pool["test_datasets"], "tokenizer": str(root / "pretrained"), "regression_tasks": [],
        "batch_size": 8,
    }
    config = root / "config"
    for kind, name, content in (("modelpool", "Seq2SeqLMPool/tiny_t5", modelpool), ("taskpool", "tiny_t5_text", taskpool)):
        (config / kind / name).parent.mkdir(parents=True, exist_ok=True)
        (config / kind / f"{name}.yaml").write_text(yaml.safe_dump(content))
    return {"root": root, "config_dir": str(config), "tasks": list(words)}
