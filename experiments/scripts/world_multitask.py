"""How well one vision tower of the offline CLIP world can serve all of its tasks at once: multi-task learning.

The paper's Table 1 has a "Traditional MTL" row (one model trained on all eight tasks with labels: 88.6 on ViT-B/32,
against 90.3 for the experts). It bounds what any single merged and calibrated model of that size can reach, and it
involves neither merging nor FeatCal. This script measures it on a built world: the base's vision tower trained with
the experts' own recipe (AdamW, the world's fine-tuning learning rate and weight decay, warm-up and cosine decay,
frozen zero-shot heads from the base text tower), for as many steps as all the experts together (steps cycle
through the tasks, one task's batch per step, drawn from that task's full train split), then scored on every test
set beside the world's own regime figures (zero-shot, experts, Task Arithmetic 0.3).

Usage:
  python experiments/scripts/world_multitask.py                     # the registered `clip` world
  python experiments/scripts/world_multitask.py --root outputs/world_ablation/ref --out experiments/results/offline_world/multitask_ref
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from featcal_fusionbench.integration.reporting import result_header, write_results

REPO = Path(__file__).resolve().parents[2]


def load_world(root: Path):
    """The built world's CLIP model, base vision tower, and per task (head, train pixels, train labels, test pixels,
    test labels)."""
    from datasets import load_from_disk
    from transformers import CLIPModel, CLIPProcessor, CLIPVisionModel

    from featcal_experiments.worlds.clip_common import zero_shot_head
    from featcal_experiments.worlds.clip_world import _pixels

    meta = json.loads((root / "world.json").read_text())
    clip = CLIPModel.from_pretrained(root / "pretrained").eval()
    processor = CLIPProcessor.from_pretrained(root / "pretrained")
    tasks = {}
    for task, classnames in meta["classnames"].items():
        split = {}
        for name in ("train", "test"):
            data = load_from_disk(str(root / "data" / task / name))
            images = np.stack([np.asarray(x.convert("RGB")) for x in data["image"]])
            split[name] = (_pixels(processor.image_processor, images), torch.as_tensor(data["label"]))
        head = zero_shot_head(clip, processor.tokenizer, classnames, meta["templates"])
        tasks[task] = (head, *split["train"], *split["test"])
    return meta, clip, CLIPVisionModel.from_pretrained(root / "pretrained"), tasks


def train_multitask(meta: dict, clip, tower, tasks: dict, steps_per_task: int, seed: int) -> dict:
    """Train ``tower`` on every task with the experts' recipe; return its test accuracy (%) per task."""
    from featcal_experiments.worlds.clip_world import accuracy
    from featcal_experiments.worlds.clip_common import train_vision_tower

    spec = meta["spec"]
    train_vision_tower(
        clip, tower.vision_model, [(head, px, lab) for head, px, lab, _, _ in tasks.values()],
        steps_per_task * len(tasks), spec["finetune_batch"], spec["finetune_lr"], torch.Generator().manual_seed(seed),
        weight_decay=spec["finetune_weight_decay"], cosine=True, progress="multi-task training",
    )
    return {t: 100 * accuracy(clip, tower.vision_model, head, px, lab) for t, (head, _, _, px, lab) in tasks.items()}


def markdown(results: dict) -> str:
    tasks = [t for t in results["multitask"] if t != "average"]
    lines = [
        "# One vision tower for every task: multi-task learning on the offline CLIP world",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; date: {results['date']}; {results['seconds'] / 60:.1f} min.  ",
        f"World: {results['world']}.  ",
        f"Training: the experts' recipe (AdamW, lr {results['recipe']['lr']}, weight decay "
        f"{results['recipe']['weight_decay']}, batch {results['recipe']['batch']}, warm-up and cosine decay), "
        f"{results['recipe']['steps']} steps cycling through the {len(tasks)} tasks ({results['recipe']['steps_per_task']} "
        f"per task, as many as each expert had), seed {results['seed']}. Accuracy in %, every test image.",
        "",
        "| model | " + " | ".join(tasks) + " | average |",
        "|---|" + "---|" * (len(tasks) + 1),
    ]
    for name, accs in results["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{accs[t]:.1f}" for t in tasks) + f" | {accs['average']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="a built CLIP world (default: the registered `clip`)")
    parser.add_argument("--steps-per-task", type=int, default=None,
                        help="training steps per task (default: the world's expert fine-tuning steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "offline_world" / "multitask")
    args = parser.parse_args(argv)
    if args.steps_per_task is not None and args.steps_per_task < 1:
        parser.error("--steps-per-task must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from featcal_experiments.worlds.registry import build_fingerprint, world_path

    root = args.root or world_path("clip")
    if not (root / "world.json").is_file():
        parser.error(f"no built world at {root}; build it with: featcal-world build clip")
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    meta, clip, tower, tasks = load_world(root)
    steps = args.steps_per_task or meta["spec"]["finetune_steps"]
    multitask = train_multitask(meta, clip, tower, tasks, steps, args.seed)
    figures = meta["figures"]

    def row(accs: dict) -> dict:
        accs = {t: float(accs[t]) for t in tasks}
        return {**accs, "average": statistics.fmean(accs.values())}

    rows = {
        "Pretrained (zero-shot; world.json)": row({t: 100 * figures["zero_shot"][t] for t in tasks}),
        "Individual experts (world.json)": row({t: 100 * figures["expert"][t] for t in tasks}),
        "Task Arithmetic 0.3 (world.json)": row({t: 100 * figures["task_arithmetic"][t] for t in tasks}),
        "Multi-task learning (one tower)": row(multitask),
    }
    spec = meta["spec"]
    results = {
        **result_header("experiments/scripts/world_multitask.py", argv),
        "world": f"{root.name}, world.json sha1 {build_fingerprint(root)}",
        "seed": args.seed,
        "recipe": {"lr": spec["finetune_lr"], "weight_decay": spec["finetune_weight_decay"],
                   "batch": spec["finetune_batch"], "steps_per_task": steps, "steps": steps * len(tasks)},
        "multitask": row(multitask),
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    write_results(args.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
