import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# The product's tests run without the experiments: a package that refuses to import shadows them, here and in every
# process the tests start (the fusion_bench CLI).
NO_EXPERIMENTS = str(HERE / "no_experiments")
sys.path.insert(0, NO_EXPERIMENTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [NO_EXPERIMENTS, os.environ.get("PYTHONPATH")]))

import commands  # noqa: E402
from scheduling import pytest_collection_modifyitems, pytest_configure  # noqa: E402,F401  (hooks)

commands.share_the_cores()


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """A toy CLIP world on disk (two tasks), with FusionBench pool and task-pool YAMLs (``toy_world.py``)."""
    from toy_world import build_toy_world

    return build_toy_world(tmp_path_factory.mktemp("toy_world"))


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
        "_target_": "featcal_fusionbench.evaluation.text_taskpool.TextGenerationTaskPool", "_recursive_": False,
        "test_datasets": pool["test_datasets"], "tokenizer": str(root / "pretrained"), "regression_tasks": [],
        "batch_size": 8,
    }
    config = root / "config"
    for kind, name, content in (("modelpool", "Seq2SeqLMPool/tiny_t5", modelpool), ("taskpool", "tiny_t5_text", taskpool)):
        (config / kind / name).parent.mkdir(parents=True, exist_ok=True)
        (config / kind / f"{name}.yaml").write_text(yaml.safe_dump(content))
    return {"root": root, "config_dir": str(config), "tasks": list(words)}


@pytest.fixture(scope="session")
def tiny_llama_pool(tmp_path_factory):
    """A CausalLMPool config on disk: a tiny Llama base with a chat-template tokenizer, two experts, text examples
    (prompt / response) as each task's train split, and an lm-eval task pool over two local tasks (a generated
    answer scored by exact match for `math`, a text's bits per byte for `coding`)."""
    import json

    import yaml
    from datasets import Dataset

    from helpers import CHAT, byte_tokenizer, perturbed, tiny_causal_lm

    root = tmp_path_factory.mktemp("tiny_llama")
    base = tiny_causal_lm("llama", vocab=384)
    base.save_pretrained(root / "base")
    byte_tokenizer(CHAT).save_pretrained(root / "base")
    pool = {"_target_": "fusion_bench.modelpool.CausalLMPool", "_recursive_": False, "tokenizer": str(root / "base"),
            "models": {"_pretrained_": str(root / "base")}, "train_datasets": {}}
    for i, task in enumerate(("math", "coding")):
        perturbed(base, 0.05, 10 + i).save_pretrained(root / task)
        pool["models"][task] = str(root / task)
        Dataset.from_dict({"prompt": [f"{task} question {k}" for k in range(12)],
                           "response": [f"answer {k * (i + 2)}" for k in range(12)]}).save_to_disk(root / f"{task}_data")
        pool["train_datasets"][task] = {"_target_": "datasets.load_from_disk", "dataset_path": str(root / f"{task}_data")}

    tasks = root / "lm_eval_tasks"
    tasks.mkdir()
    rows = {"tiny_sums": [{"question": f"{k}+{k}=", "answer": str(2 * k)} for k in range(6)],
            "tiny_text": [{"text": f"def f{k}(x): return x * {k}"} for k in range(6)]}
    for name, docs in rows.items():
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "test_split": "test"}
    specs = {
        "tiny_sums": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]},
        "tiny_text": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                      "metric_list": [{"metric": "bits_per_byte"}, {"metric": "byte_perplexity"}]},
    }
    for name, spec in specs.items():
        data = {"dataset_kwargs": {"data_files": {"test": str(tasks / f"{name}.jsonl")}}}
        (tasks / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **common, **data, **spec}))
    taskpool = {
        "_target_": "featcal_fusionbench.evaluation.lm_eval_taskpool.LMEvalTaskPool", "include_path": str(tasks),
        "tokenizer": str(root / "base"), "batch_size": 4, "apply_chat_template": True,
        "tasks": {"tiny_sums": {"metric": "exact_match,none", "expert": "math"},
                  "tiny_text": {"metric": "bits_per_byte,none", "expert": "coding"}},
    }
    for kind, name, content in (("modelpool", "tiny_llama", pool), ("taskpool", "LMEvalHarnessTaskPool/tiny_llama", taskpool)):
        (root / "config" / kind / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "config" / kind / f"{name}.yaml").write_text(yaml.safe_dump(content))
    return {"root": root, "base": base, "config_dir": str(root / "config"),
            "search": f"hydra.searchpath=[file://{root / 'config'}]"}
