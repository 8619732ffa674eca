"""What governs how much of the experts' accuracy FeatCal recovers when it calibrates toward several experts at once.

For a built offline world (the registered `clip` world by default, or reduced variants built here with --variant),
every subset of tasks in --subsets is merged by Task Arithmetic (0.3) and calibrated by FeatCal (the paper's values)
toward that subset's experts only; each task's recovery is (FeatCal - TA) / (expert - TA). Single tasks give what one
linear map per module can do for one expert; pairs and larger sets show what is lost when one map must serve several.
Beside each pair, two FeatCal-free properties of the world: how much each task's vector (x 0.3) alone costs the other
task against the base (pairwise interference: the absence of weight disentanglement), and how much the two tasks'
module inputs overlap in the base model (the Frobenius cosine of their normalised uncentred second moments, averaged
over the calibrated linear modules). Per task: the base, the base plus the other tasks' vectors (x 0.3), the base plus
a random perturbation with the same per-tensor norms (a control: is the base merely fragile?), and the base plus the
task's own vector (x 0.3). None of this chooses the world: it is measured after the world is fixed by its regime
checks.

Usage:
  python experiments/scripts/world_ablation.py                                   # the built `clip` world
  python experiments/scripts/world_ablation.py --variant w64:width=64 --variant w256:width=256 \\
      --tasks mnist,fashion_mnist,optical_digits,latin --subsets singles,pairs,all --out experiments/results/offline_world/width
Each --variant NAME:KEY=VALUE,... builds a reduced world from the `clip` world's spec with those fields changed (and
--tasks, --variant-steps) under --runs, once; an interrupted invocation resumes.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf

from featcal_fusionbench.families import family_for
from featcal_fusionbench.integration.data import select_calibration_data
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.integration.reporting import result_header, write_results
from featcal_experiments.worlds.clip_world import CLIP8, build_clip_world
from featcal_experiments.worlds.registry import build_world, world_path
from featcal_experiments.worlds.task_vectors import moved, scaled_task_vector_sum
from fusion_bench.utils import instantiate

REPO = Path(__file__).resolve().parents[2]


class World:
    """A built world's pool, experts and evaluation, in process."""

    def __init__(self, root: Path, tasks=None):
        self.root = root
        self.meta = json.loads((root / "world.json").read_text())
        config = root / "config"
        self.pool_cfg = OmegaConf.load(next((config / "modelpool").rglob("*.yaml")))
        self.taskpool_cfg = OmegaConf.load(next((config / "taskpool").rglob("*.yaml")))
        self.pool = instantiate(self.pool_cfg)
        self.tasks = list(tasks or self.pool.model_names)
        self.base = self.pool.load_pretrained_model().eval()
        self.experts = {t: self.pool.load_model(t).eval() for t in self.tasks}
        self.fabric = L.Fabric(accelerator="cpu", devices=1)

    def evaluate(self, model, tasks) -> dict:
        cfg = self.taskpool_cfg.copy()
        cfg.test_datasets = {t: cfg.test_datasets[t] for t in tasks}
        taskpool = instantiate(cfg)
        taskpool._fabric_instance = self.fabric
        report = taskpool.evaluate(model)
        return {t: 100 * report[t]["accuracy"] for t in tasks}

    def task_arithmetic(self, tasks, scale: float = 0.3):
        return self.perturbed(self.task_vector_sum(tasks, scale))

    def task_vector_sum(self, tasks, scale: float = 0.3) -> dict:
        return scaled_task_vector_sum(self.base.state_dict(), [self.experts[t].state_dict() for t in tasks], scale)

    def perturbed(self, delta: dict):
        return moved(self.base, delta)

    def interference(self, seed: int) -> dict:
        """Per task: accuracy of the base, of the base plus the other tasks' vectors (x 0.3), of the base plus a
        random perturbation with the very same per-tensor norms, and of the base plus its own vector (x 0.3)."""
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for task in self.tasks:
            others = self.task_vector_sum([t for t in self.tasks if t != task])
            noise = {}
            for key, delta in others.items():
                r = torch.randn(delta.shape, generator=generator, dtype=delta.dtype)
                noise[key] = r * (delta.norm() / r.norm()) if delta.norm() > 0 else delta
            models = {
                "base": self.base, "base + others": self.perturbed(others), "base + random, same norms": self.perturbed(noise),
                "base + own": self.task_arithmetic([task]),
            }
            out[task] = {name: self.evaluate(m, [task])[task] for name, m in models.items()}
        return out

    def featcal(self, merged, tasks, hparams: FeatCalHParams):
        family = family_for(self.base)
        data = select_calibration_data(self.pool, tasks, hparams.num_calibration_examples, hparams.seed)
        batches = {t: family.batches(self.pool, data[t], hparams.batch_size) for t in tasks}
        model = copy.deepcopy(merged)
        FeatCalEngine(family, hparams, torch.device("cpu"), progress=False).run(
            model, self.base, {t: self.experts[t] for t in tasks}, batches
        )
        return model

    @torch.no_grad()
    def input_overlap(self, n: int, seed: int) -> dict:
        """Per pair of tasks: mean over linear modules of cos_F(G_i, G_j), G = uncentred second moment of the
        module's input in the base model over n train examples (all tokens)."""
        family = family_for(self.base)
        linears = {
            name: module for name, module in self.base.named_modules() if isinstance(module, torch.nn.Linear)
            and ".encoder.layers." in name
        }
        data = select_calibration_data(self.pool, self.tasks, n, seed)
        grams = {}
        for task in self.tasks:
            sums = {name: 0.0 for name in linears}

            def hook(name):
                def capture(_module, args):
                    x = args[0].reshape(-1, args[0].shape[-1]).double()
                    sums[name] = sums[name] + x.T @ x

                return capture

            handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
            try:
                for pixels in family.batches(self.pool, data[task], 64):
                    self.base(pixel_values=pixels)
            finally:
                for h in handles:
                    h.remove()
            grams[task] = {name: g / torch.linalg.matrix_norm(g) for name, g in sums.items()}
        return {
            f"{a}+{b}": statistics.fmean(float((grams[a][m] * grams[b][m]).sum()) for m in linears)
            for a, b in itertools.combinations(self.tasks, 2)
        }


def subsets_of(spec: str, tasks) -> list:
    out = []
    for part in spec.split(","):
        if part == "singles":
            out += [[t] for t in tasks]
        elif part == "pairs":
            out += [list(p) for p in itertools.combinations(tasks, 2)]
        elif part == "all":
            out.append(list(tasks))
        else:
            chosen = part.split("+")
            unknown = [t for t in chosen if t not in tasks]
            if unknown:
                raise SystemExit(f"unknown task(s) {unknown} in --subsets; tasks: {', '.join(tasks)}")
            out.append(chosen)
    unique = []
    for subset in out:  # e.g. with two tasks, "pairs" and "all" name the same subset
        if subset not in unique:
            unique.append(subset)
    return unique


def analyse(world: World, subsets, hparams: FeatCalHParams) -> dict:
    experts = {t: world.evaluate(world.experts[t], [t])[t] for t in world.tasks}
    base = world.evaluate(world.base, world.tasks)
    rows = []
    for tasks in subsets:
        started = time.perf_counter()
        merged = world.task_arithmetic(tasks)
        ta = world.evaluate(merged, tasks)
        fc = world.evaluate(world.featcal(merged, tasks, hparams), tasks)
        recovery = {t: (fc[t] - ta[t]) / (experts[t] - ta[t]) if experts[t] - ta[t] > 0 else None for t in tasks}
        gap = statistics.fmean(experts[t] - ta[t] for t in tasks)
        if len(tasks) == 2:  # what each task's vector alone costs the other one
            a, b = tasks
            cost = [base[a] - world.evaluate(world.task_arithmetic([b]), [a])[a],
                    base[b] - world.evaluate(world.task_arithmetic([a]), [b])[b]]
        rows.append({
            "pair_interference": statistics.fmean(cost) if len(tasks) == 2 else None,
            "tasks": tasks,
            "task_arithmetic": ta,
            "featcal": fc,
            "recovery": recovery,
            "average_recovery": statistics.fmean(fc[t] - ta[t] for t in tasks) / gap if gap > 0 else None,
        })
        print(f"  {'+'.join(tasks)}: TA {statistics.fmean(ta.values()):.1f} FeatCal {statistics.fmean(fc.values()):.1f} "
              f"recovery {rows[-1]['average_recovery']} ({time.perf_counter() - started:.0f} s)", flush=True)
    return {"experts": experts, "base": base, "rows": rows}


def markdown(results: dict) -> str:
    lines = [
        "# FeatCal's joint recovery on offline worlds: an ablation",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; date: {results['date']}; FeatCal: lambda {results['hparams']['lambda_']}, "
        f"rho {results['hparams']['rho']}, alpha {results['hparams']['alpha']}, n = {results['hparams']['num_calibration_examples']} "
        "per task; upstream Task Arithmetic (0.3) over the subset's experts only.",
        "",
        "Recovery = (FeatCal - TA) / (expert - TA), averaged over the subset's tasks (a ratio of average gaps).",
    ]
    for name, world in results["worlds"].items():
        figures = world["figures"]
        lines += [
            "",
            f"## {name}",
            "",
            f"World: {world['description']}. Regime figures (world.json): zero-shot {100 * figures['zero_shot_average']:.1f}, "
            f"experts {100 * figures['expert_average']:.1f}, Task Arithmetic {100 * figures['task_arithmetic_average']:.1f}"
            + (f", the other tasks' vectors alone {100 * figures['others_only_task_arithmetic_average']:.1f}"
               if "others_only_task_arithmetic_average" in figures else "")
            + ".",
            "",
        ]
        if world.get("interference"):
            columns = list(next(iter(world["interference"].values())))
            lines += [
                "Interference, per task (accuracy; vectors x 0.3):",
                "",
                "| task | " + " | ".join(columns) + " |",
                "|---|" + "---|" * len(columns),
            ]
            lines += [f"| {t} | " + " | ".join(f"{v[c]:.1f}" for c in columns) + " |" for t, v in world["interference"].items()]
            lines.append("")
        lines += [
            "| tasks | n tasks | TA | FeatCal | expert | recovery | pair interference (points) | base input overlap |",
            "|---|---|---|---|---|---|---|---|",
        ]
        def cell(value, fmt):
            return "" if value is None else format(value, fmt)

        for row in world["rows"]:
            tasks = row["tasks"]
            overlap = world["overlap"].get("+".join(tasks)) if len(tasks) == 2 else None
            recovery = None if row["average_recovery"] is None else 100 * row["average_recovery"]
            lines.append(
                f"| {' + '.join(tasks)} | {len(tasks)} | {statistics.fmean(row['task_arithmetic'].values()):.1f} | "
                f"{statistics.fmean(row['featcal'].values()):.1f} | {statistics.fmean(world['experts'][t] for t in tasks):.1f} | "
                f"{cell(recovery, '.0f')}{'%' if recovery is not None else ''} | {cell(row['pair_interference'], '.1f')} | "
                f"{cell(overlap, '.3f')} |"
            )
        summary = world.get("summary")
        if summary:
            lines += ["", "By subset size: " + "; ".join(f"{k} task(s): mean recovery {100 * v:.0f}%" for k, v in summary["by_size"].items()) + "."]
            for key, label in (("pair_interference_correlation", "pair interference"), ("pair_overlap_correlation", "input overlap")):
                if summary.get(key) is not None:
                    lines.append(f"Pairs: correlation of recovery with {label}: {summary[key]:+.2f}.")
    return "\n".join(lines) + "\n"


def summarise(world: dict) -> dict:
    by_size = {}
    for row in world["rows"]:
        if row["average_recovery"] is not None:
            by_size.setdefault(len(row["tasks"]), []).append(row["average_recovery"])
    pairs = [r for r in world["rows"] if len(r["tasks"]) == 2 and r["average_recovery"] is not None]

    def correlation(values):
        return statistics.correlation(values, [r["average_recovery"] for r in pairs]) if len(pairs) > 2 else None

    return {
        "by_size": {k: statistics.fmean(v) for k, v in sorted(by_size.items())},
        "pair_interference_correlation": correlation([r["pair_interference"] for r in pairs]),
        "pair_overlap_correlation": correlation([world["overlap"]["+".join(r["tasks"])] for r in pairs]),
    }


def parse_variant(text: str):
    name, _, assignments = text.partition(":")
    known = {f.name: f.type for f in fields(CLIP8)}
    overrides = {}
    for item in filter(None, assignments.split(",")):
        key, _, value = item.partition("=")
        if key not in known or key == "tasks":
            raise SystemExit(f"--variant {text!r}: {key!r} is not a field of the world spec")
        overrides[key] = type(getattr(CLIP8, key))(value)
    return name, overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (a reduced world)")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: all of the world)")
    parser.add_argument(
        "--variant-steps", default="pretrain_steps=600,caption_class_share=0.2",
        help="spec overrides shared by variants (the default: the reduced reference of experiments/results/offline_world/)",
    )
    parser.add_argument("--subsets", default="singles,pairs,all")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runs", type=Path, default=REPO / "outputs" / "world_ablation")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "offline_world" / "ablation")
    args = parser.parse_args(argv)
    hparams = FeatCalHParams(num_calibration_examples=args.n, seed=args.seed)
    variants = [parse_variant(v) for v in args.variant]
    _, shared = parse_variant("shared:" + args.variant_steps)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {
        **result_header("experiments/scripts/world_ablation.py", argv),
        "hparams": {k: getattr(hparams, k) for k in ("lambda_", "rho", "alpha", "num_calibration_examples", "seed")},
        "worlds": {},
    }
    if variants:
        task_names = args.tasks.split(",") if args.tasks else CLIP8.task_names
        specs = {t.name: t for t in CLIP8.tasks}
        targets = []
        for name, overrides in variants:
            spec = replace(CLIP8, name=name, tasks=[specs[t] for t in task_names], **{**shared, **overrides})
            root = args.runs / name
            if not (root / "world.json").is_file():
                print(f"building variant {name}: {overrides}", flush=True)
                build_clip_world(root, spec)
            targets.append((name, root, f"{len(task_names)} tasks, spec changes {dict(shared, **overrides)}"))
    else:
        build_world("clip")
        targets = [("clip", world_path("clip"), "the registered offline CLIP world")]

    for name, root, description in targets:
        print(f"{name}: {root}", flush=True)
        world = World(root, args.tasks.split(",") if args.tasks and not variants else None)
        entry = {"description": description, "figures": world.meta["figures"]}
        entry.update(analyse(world, subsets_of(args.subsets, world.tasks), hparams))
        entry["overlap"] = world.input_overlap(args.n, args.seed)
        entry["interference"] = world.interference(args.seed)
        entry["summary"] = summarise(entry)
        results["worlds"][name] = entry

    write_results(args.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
