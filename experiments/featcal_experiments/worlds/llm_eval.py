"""The LLM world's lm-eval-harness tasks: task YAMLs over the world's local jsonl files (an ``include_path``
folder), and a direct ``simple_evaluate`` for the build's own regime figures.

Each task has a test variant (``llm_math``) and a validation variant (``llm_math_val``, train-side examples held out
from training, which choose Task Arithmetic's scale). Generation is greedy, with the chat template, stops at the
tokenizer's eos (``<|im_end|>``, which HFLM adds to every task's stop list) and is capped at a few tokens. The data
are read by a ``custom_dataset`` function relative to the tasks folder, so a world renamed into place (or moved)
keeps working.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

# task -> (the metric process_results returns, max_gen_toks, extra stop sequences, runs code?)
TASK_SETTINGS = {
    # the math answer is a few equations and a sentence; a new line means the model started something else
    "math": ("exact_match", 64, ["\n\n"], False),
    "code": ("pass@1", 96, ["\n```\n", "\nif __name__"], True),
    "instruction": ("prompt_level_strict_acc", 96, [], False),
}
SPLITS = {"test": "", "validation": "_val"}


def task_name(task: str, split: str = "test") -> str:
    return f"llm_{task}{SPLITS[split]}"


def metric_key(task: str) -> str:
    """lm-eval's results key ("metric,filter") of a task's score."""
    return f"{TASK_SETTINGS[task][0]},none"


UTILS = '''"""lm-eval hooks of the offline LLM world (written by its build): data from ../data, scoring from featcal_experiments."""
import json
from pathlib import Path

import datasets

from featcal_experiments.worlds.llm_scoring import code_results, instruction_results, math_results  # noqa: F401

DATA = Path(__file__).resolve().parent.parent / "data"


def _load(task, **_metadata):
    # from_list, not from_json: no copy in the datasets cache
    def rows(split):
        with open(DATA / task / f"{split}.jsonl") as handle:
            return [json.loads(line) for line in handle]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows(split)) for split in ("validation", "test")})


def load_math(**kwargs):
    return _load("math", **kwargs)


def load_code(**kwargs):
    return _load("code", **kwargs)


def load_instruction(**kwargs):
    return _load("instruction", **kwargs)
'''


class _Function(str):
    """A YAML ``!function`` tag, which lm-eval's loader resolves against the folder's utils.py."""


yaml.SafeDumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def task_config(task: str, split: str, max_gen_toks_cap: Optional[int] = None) -> Dict:
    metric, max_gen_toks, until, unsafe = TASK_SETTINGS[task]
    if max_gen_toks_cap is not None:  # reduced worlds: a short answer is enough to exercise the pipeline
        max_gen_toks = min(max_gen_toks, max_gen_toks_cap)
    config = {
        "task": task_name(task, split),
        "custom_dataset": _Function(f"utils.load_{task}"),
        "output_type": "generate_until",
        "test_split": split,
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{response}}",
        "process_results": _Function(f"utils.{task}_results"),
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": list(until), "max_gen_toks": max_gen_toks, "do_sample": False},
        "num_fewshot": 0,
        "metadata": {"version": 1.0},
    }
    if unsafe:
        config["unsafe_code"] = True
    return config


def write_task_folder(folder: Path, tasks: Sequence[str], max_gen_toks_cap: Optional[int] = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(UTILS)
    for task in tasks:
        for split in SPLITS:
            path = folder / f"{task_name(task, split)}.yaml"
            path.write_text(yaml.safe_dump(task_config(task, split, max_gen_toks_cap), sort_keys=False))
    return folder


def write_jsonl(path: Path, rows: List[Dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def world_task_manager(include_path: Path):
    """lm-eval's ``TaskManager`` over the world's task folder alone: the world's task files are self-contained, so
    lm-eval's own ~14,000 (8-20 s to index on 2 cores) are left out of the index."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path), include_defaults=False)


def evaluate(model, tokenizer, include_path: Path, tasks: Sequence[str], split: str = "test",
             batch_size: int = 8, limit: Optional[int] = None, task_manager=None) -> Dict[str, float]:
    """Score ``model`` on the world's tasks through ``lm_eval.simple_evaluate``: task -> score in [0, 1].
    ``task_manager``: ``world_task_manager(include_path)``'s, to reuse."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from featcal_fusionbench.evaluation.lm_eval_taskpool import environment_described_once

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    names = {task_name(task, split): task for task in tasks}
    with environment_described_once():  # a build scores seven models
        out = simple_evaluate(
            model=lm, tasks=list(names), task_manager=task_manager or world_task_manager(include_path),
            apply_chat_template=True, confirm_run_unsafe_code=True, limit=limit, log_samples=False,
        )
    return {task: float(out["results"][name][metric_key(task)]) for name, task in names.items()}
