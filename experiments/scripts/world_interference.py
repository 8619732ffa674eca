"""Where the offline CLIP world's task interference lives: in which parameters, and in what form.

In the offline CLIP world, adding the other tasks' vectors (x 0.3) to the base costs a task many points while a random
perturbation with the same per-tensor norms costs none (experiments/scripts/world_ablation.py): the experts' vectors are not
weight-disentangled. This script asks two FeatCal-free questions about that damage, per task:

- its form: is the information still in the final image features? The accuracy of base + others after removing the
  mean shift of the features, and after an affine map back to the base's features, both fitted on the task's
  unlabeled train images (never the test images that are scored);
- its place: the accuracy when the other tasks' vectors are added only to one group of parameters (the embeddings,
  one block's attention or MLP, the layer norms), beside each group's share of the task vectors' norm relative to
  the base's weights.

Accuracy is FusionBench's zero-shot classification (class names x templates, normalised features), computed in
process on the world's test sets; its "base" and "base + others" columns are the world build's own regime figures.

Usage:
  python experiments/scripts/world_interference.py                      # the registered `clip` world
  python experiments/scripts/world_interference.py --root outputs/world_ablation/ref --out experiments/results/offline_world/interference_ref
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch
import torch.nn.functional as F

from featcal_fusionbench.integration.reporting import result_header, write_results
from featcal_experiments.worlds.clip_world import image_features
from featcal_experiments.worlds.task_vectors import moved, scaled_task_vector_sum

REPO = Path(__file__).resolve().parents[2]
SCALE = 0.3  # Task Arithmetic's coefficient, as in the world's regime figures


def parameter_groups(keys: List[str]) -> Dict[str, Callable[[str], bool]]:
    """The vision tower's parameters by role: embeddings, each block's attention and MLP, every layer norm."""
    blocks = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in keys if ".layers." in k})
    groups: Dict[str, Callable[[str], bool]] = {"embeddings": lambda k: ".embeddings." in k}
    for i in blocks:
        groups[f"block {i} attention"] = lambda k, i=i: f".layers.{i}.self_attn." in k
        groups[f"block {i} MLP"] = lambda k, i=i: f".layers.{i}.mlp." in k
    groups["layer norms"] = lambda k: "layer_norm" in k or "layrnorm" in k or "layernorm" in k
    # each parameter in exactly one group, so that the groups' rows add up to the whole perturbation
    misplaced = [k for k in keys if sum(f(k) for f in groups.values()) != 1]
    if misplaced:
        raise ValueError(f"parameters not in exactly one group: {misplaced[:5]}")
    return groups


def affine_fit(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Least-squares [W; b] with [source, 1] @ [W; b] ~ target (float64)."""
    ones = torch.ones(len(source), 1, dtype=torch.float64)
    return torch.linalg.lstsq(torch.cat([source.double(), ones], 1), target.double()).solution


def apply_affine(features: torch.Tensor, map_: torch.Tensor) -> torch.Tensor:
    return torch.cat([features.double(), torch.ones(len(features), 1, dtype=torch.float64)], 1) @ map_


class WorldFeatures:
    """A built CLIP world's base, experts, zero-shot heads and pixels, for feature-level measurements."""

    def __init__(self, root: Path, n_train: int, seed: int):
        from datasets import load_from_disk
        from transformers import CLIPModel, CLIPProcessor, CLIPVisionModel

        from featcal_experiments.worlds.clip_common import zero_shot_head
        from featcal_experiments.worlds.clip_world import _pixels

        self.meta = json.loads((root / "world.json").read_text())
        self.tasks = list(self.meta["classnames"])
        self.clip = CLIPModel.from_pretrained(root / "pretrained").eval()
        processor = CLIPProcessor.from_pretrained(root / "pretrained")
        self.heads = {
            t: zero_shot_head(self.clip, processor.tokenizer, self.meta["classnames"][t], self.meta["templates"])
            for t in self.tasks
        }
        self.pixels, self.labels = {}, {}
        for t in self.tasks:
            for split in ("train", "test"):
                data = load_from_disk(str(root / "data" / t / split))
                if split == "train":  # unlabeled images to fit the maps on; labels are never read
                    data = data.shuffle(seed=seed).select(range(min(n_train, len(data))))
                else:
                    self.labels[t] = torch.as_tensor(data["label"])
                images = np.stack([np.asarray(x.convert("RGB")) for x in data["image"]])
                self.pixels[t, split] = _pixels(processor.image_processor, images)
        self.base = CLIPVisionModel.from_pretrained(root / "pretrained").eval()
        self.base_state = self.base.state_dict()
        self.experts = {t: CLIPVisionModel.from_pretrained(root / "experts" / t).state_dict() for t in self.tasks}

    def features(self, model, task: str, split: str) -> torch.Tensor:
        """The image embeddings the zero-shot head reads, before normalisation (shifts and maps act on these)."""
        return image_features(self.clip, model.vision_model, self.pixels[task, split], normalize=False).double()

    def accuracy(self, features: torch.Tensor, task: str) -> float:
        if not torch.isfinite(features).all():
            raise FloatingPointError(f"non-finite image features on {task}")
        logits = F.normalize(features, dim=-1) @ self.heads[task].double().T
        return 100 * float((logits.argmax(-1) == self.labels[task]).double().mean())


def relative_norms(world: WorldFeatures, groups) -> Dict[str, float]:
    """Per group: the experts' mean ||delta_group|| / ||W_group|| (the size of each task's step there)."""
    out = {}
    for name, keep in groups.items():
        base = torch.cat([v.flatten().double() for k, v in world.base_state.items() if keep(k)]).norm()
        steps = [
            torch.cat([(e[k] - v).flatten().double() for k, v in world.base_state.items() if keep(k)]).norm() / base
            for e in world.experts.values()
        ]
        out[name] = 100 * float(statistics.fmean(float(s) for s in steps))
    return out


def measure(world: WorldFeatures) -> dict:
    groups = parameter_groups(list(world.base_state))
    rows = {}
    for task in world.tasks:
        others = scaled_task_vector_sum(world.base_state, [world.experts[t] for t in world.tasks if t != task], SCALE)
        perturbed = moved(world.base, others)
        base_train, others_train = world.features(world.base, task, "train"), world.features(perturbed, task, "train")
        others_test = world.features(perturbed, task, "test")
        row = {
            "base": world.accuracy(world.features(world.base, task, "test"), task),
            "base + others": world.accuracy(others_test, task),
            "base + others, mean shift removed": world.accuracy(
                others_test - (others_train.mean(0) - base_train.mean(0)), task
            ),
            "base + others, affine map back to the base": world.accuracy(
                apply_affine(others_test, affine_fit(others_train, base_train)), task
            ),
        }
        for name, keep in groups.items():
            model = moved(world.base, {k: v for k, v in others.items() if keep(k)})
            row[f"others only in {name}"] = world.accuracy(world.features(model, task, "test"), task)
        rows[task] = row
        print(f"{task}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return {"per_task": rows, "relative_step_percent": relative_norms(world, groups)}


def markdown(results: dict) -> str:
    rows = results["per_task"]
    tasks = list(rows)
    columns = list(next(iter(rows.values())))
    lines = [
        "# Where the offline CLIP world's task interference lives",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; date: {results['date']}; world: {results['world']}; "
        f"Task Arithmetic coefficient {SCALE}; maps fitted on {results['n_train']} unlabeled train images per task.",
        "",
        "Accuracy (%) of each task when the *other* tasks' vectors are added to the base, and what is left of the "
        "damage after an output-side correction or when the vectors touch one parameter group only.",
        "",
        "| | " + " | ".join(tasks) + " | mean |",
        "|---|" + "---|" * (len(tasks) + 1),
    ]
    for column in columns:
        values = [rows[t][column] for t in tasks]
        lines.append(f"| {column} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.fmean(values):.1f} |")
    lines += [
        "",
        "The experts' step per parameter group, mean over experts of ||delta|| / ||W|| (%):",
        "",
        "| group | relative step (%) |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} |" for k, v in results["relative_step_percent"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="a built CLIP world (default: the registered `clip`)")
    parser.add_argument("--n-train", type=int, default=256, help="unlabeled train images per task for the maps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "offline_world" / "interference")
    args = parser.parse_args(argv)
    if args.n_train < 2:
        parser.error("--n-train must be at least 2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from featcal_experiments.worlds.registry import build_fingerprint, world_path

    root = args.root or world_path("clip")
    if not (root / "world.json").is_file():
        parser.error(f"no built world at {root}; build it with: featcal-world build clip")
    torch.manual_seed(args.seed)
    world = WorldFeatures(root, args.n_train, args.seed)
    results = {
        **result_header("experiments/scripts/world_interference.py", argv),
        "world": f"{root.name}, world.json sha1 {build_fingerprint(root)}",
        "n_train": args.n_train,
        **measure(world),
    }
    write_results(args.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
