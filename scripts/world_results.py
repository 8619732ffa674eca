"""Results of an offline world, by one command: references, every upstream merger with and without FeatCal, and
Task Arithmetic + FeatCal's average accuracy against the number of calibration examples.

Usage:
  python scripts/world_results.py                      # offline_clip8, writes docs/results/offline_clip8.{md,json,png}
  python scripts/world_results.py --subset offline_clip4 --seeds 0 --sweep-n 16,64

Every merged model runs through the `fusion_bench` CLI (method=featcal/clip_<upstream>, return_upstream=true), so the
upstream row and its FeatCal row come from one run on the same merged model. Runs are kept under --runs and skipped
when their report exists with the same command: an interrupted invocation resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from featcal_fusionbench.worlds.references import reference_accuracies
from featcal_fusionbench.worlds.registry import build_world, get_world

REPO = Path(__file__).resolve().parents[1]
FUSION_BENCH = str(Path(sys.executable).with_name("fusion_bench"))
UPSTREAMS = {
    "simple_average": "Simple Averaging",
    "ta": "Task Arithmetic",
    "adamerging": "AdaMerging (layer-wise)",
    "wudi": "WUDI",
}
# AdaMerging's default of 8 loader workers only adds process start-up on these 2-core machines.
EXTRA = {"adamerging": ["method.upstream.algorithm_config.num_workers=0"]}


def run_fusion_bench(run_dir: Path, args: list) -> dict:
    """One CLI run in its own folder; returns its program report (cached by command)."""
    command = [FUSION_BENCH, *args, "path.log_dir=."]
    report_path, command_path = run_dir / "program_report.json", run_dir / "command.txt"
    text = shlex.join(command[1:])
    if report_path.is_file() and command_path.is_file() and command_path.read_text() == text:
        return json.loads(report_path.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    report_path.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    with open(run_dir / "run.log", "w") as log:
        result = subprocess.run(command, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"fusion_bench failed in {run_dir} (see run.log there): {text}")
    command_path.write_text(text)
    report = json.loads(report_path.read_text())
    print(f"  {run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return report


def accuracies(section: dict) -> dict:
    return {k: 100 * v["accuracy"] for k, v in section.items() if isinstance(v, dict) and "accuracy" in v}


def with_average(accs: dict) -> dict:
    return {**accs, "average": statistics.fmean(accs.values())}


def markdown(results: dict) -> str:
    tasks = [t for t in results["references"]["pretrained"] if t != "average"]
    lines = [
        f"# Results on the offline world `{results['subset']}`",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; date: {results['date']}; wall time {results['wall_seconds'] / 60:.1f} min.  ",
        f"FeatCal settings: the paper's CLIP values (`method=featcal/clip_<upstream>`: lambda 0.05, rho 2.0, alpha 0.3), "
        f"n = {results['n']} calibration examples per task from each task's train split, seed {results['seed']}.",
        "",
        "| method | " + " | ".join(tasks) + " | average | FeatCal s |",
        "|---|" + "---|" * (len(tasks) + 2),
    ]

    def row(name, accs, seconds=None):
        cells = " | ".join(f"{accs[t]:.1f}" for t in [*tasks, "average"])
        return f"| {name} | {cells} | {'' if seconds is None else f'{seconds:.1f}'} |"

    lines.append(row("Pretrained (zero-shot)", results["references"]["pretrained"]))
    lines.append(row("Individual experts", results["references"]["experts"]))
    for key, entry in results["mergers"].items():
        lines.append(row(UPSTREAMS[key], entry["upstream"]))
        lines.append(row(f"{UPSTREAMS[key]} + FeatCal", entry["featcal"], entry["calibration_seconds"]))
    sweep = results.get("sweep")
    if sweep:
        lines += [
            "",
            f"## Task Arithmetic + FeatCal against n (average accuracy, seeds {', '.join(map(str, sweep['seeds']))})",
            "",
            f"Task Arithmetic alone: {sweep['upstream_average']:.1f}; experts: "
            f"{results['references']['experts']['average']:.1f}. Plot: `{Path(results['png']).name}`.",
            "",
            "| n | mean | std | per seed |",
            "|---|---|---|---|",
        ]
        for n, values in sweep["averages"].items():
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            lines.append(f"| {n} | {statistics.fmean(values):.1f} | {std:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["sweep"]
    ns = [int(n) for n in sweep["averages"]]
    means = [statistics.fmean(v) for v in sweep["averages"].values()]
    stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in sweep["averages"].values()]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(ns, means, yerr=stds, marker="o", capsize=3, label="Task Arithmetic + FeatCal")
    ax.axhline(sweep["upstream_average"], color="gray", linestyle="--", label="Task Arithmetic")
    ax.axhline(results["references"]["experts"]["average"], color="green", linestyle=":", label="experts")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration examples per task (n)")
    ax.set_ylabel("average accuracy (%)")
    ax.set_title(results["subset"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="clip")
    parser.add_argument("--subset", default="offline_clip8", help="the pools' config name")
    parser.add_argument("--upstreams", default=",".join(UPSTREAMS))
    parser.add_argument("--n", type=int, default=256, help="calibration examples per task for the merger table")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sweep-n", default="8,16,32,64,128,256", help="empty: no sweep")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--runs", type=Path, default=None, help="run folders (default outputs/world_results/SUBSET)")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default docs/results/SUBSET)")
    args = parser.parse_args(argv)

    upstreams = [u for u in args.upstreams.split(",") if u]
    unknown = [u for u in upstreams if u not in UPSTREAMS]
    if unknown:
        parser.error(f"unknown upstream(s) {unknown}; known: {', '.join(UPSTREAMS)}")
    sweep_n = [int(n) for n in args.sweep_n.split(",") if n]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if any(n < 1 for n in [args.n, *sweep_n]):
        parser.error("every n must be at least 1")
    get_world(args.world)
    import featcal_fusionbench_config

    known = sorted(p.stem for p in (Path(list(featcal_fusionbench_config.__path__)[0]) / "modelpool" / "CLIPVisionModelPool").glob("*.yaml"))
    if args.subset not in known:
        parser.error(f"no packaged pool config {args.subset!r}; known: {', '.join(known)}")
    runs = args.runs or REPO / "outputs" / "world_results" / args.subset
    out = args.out or REPO / "docs" / "results" / args.subset
    started = time.perf_counter()
    build_world(args.world)

    pools = [f"modelpool=CLIPVisionModelPool/{args.subset}", f"taskpool=CLIPVisionModelTaskPool/{args.subset}"]
    print("references (pretrained zero-shot, experts)", flush=True)
    refs = reference_accuracies(args.world, f"CLIPVisionModelPool/{args.subset}", f"CLIPVisionModelTaskPool/{args.subset}")
    results = {
        "subset": args.subset,
        "command": shlex.join(["python", "scripts/world_results.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "date": date.today().isoformat(),
        "n": args.n,
        "seed": args.seed,
        "references": {k: with_average({t: 100 * a for t, a in v.items()}) for k, v in refs.items()},
        "mergers": {},
    }
    for upstream in upstreams:
        print(f"{UPSTREAMS[upstream]} and + FeatCal", flush=True)
        report = run_fusion_bench(runs / upstream, [
            *pools, f"method=featcal/clip_{upstream}", "method.return_upstream=true",
            f"method.num_calibration_examples={args.n}", f"method.seed={args.seed}", *EXTRA.get(upstream, []),
        ])
        results["mergers"][upstream] = {
            "upstream": accuracies(report["upstream"]),
            "featcal": accuracies(report["featcal"]),
            "calibration_seconds": report["featcal_calibration"]["seconds"],
        }
    if sweep_n:
        averages, upstream_average = {}, None
        for n in sweep_n:
            for seed in seeds:
                print(f"sweep n={n} seed={seed}", flush=True)
                report = run_fusion_bench(runs / f"sweep_n{n}_seed{seed}", [
                    *pools, "method=featcal/clip_ta", "method.return_upstream=true",
                    f"method.num_calibration_examples={n}", f"method.seed={seed}",
                ])
                averages.setdefault(str(n), []).append(accuracies(report["featcal"])["average"])
                upstream_average = accuracies(report["upstream"])["average"]
        results["sweep"] = {"seeds": seeds, "averages": averages, "upstream_average": upstream_average}
        results["png"] = out.with_suffix(".png").name
    results["wall_seconds"] = time.perf_counter() - started

    out.parent.mkdir(parents=True, exist_ok=True)
    if sweep_n:
        plot(results, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
