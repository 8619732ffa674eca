"""Results of an offline world, by one command: references, every upstream merger alone and with FeatCal, Surgery
and ProbSurgery, and each calibrator's average accuracy after Task Arithmetic against the number of calibration
examples per task.

Usage:
  python experiments/scripts/world_results.py                      # offline_clip8, writes experiments/results/offline_clip8.{md,json,png}
  python experiments/scripts/world_results.py --subset offline_clip4 --seeds 0 --sweep-n 16,64 --calibrators featcal

Every merged model runs through the `fusion_bench` CLI (method=<calibrator>/clip_<upstream>, return_upstream=true),
so each calibrated row and its upstream row come from one run on the same merged model; AdaMerging's merging weights
are learnt once (in the FeatCal run) and reused by the other calibrators. Each row carries the calibration stage's
seconds and the process's peak RSS up to the end of calibration, from the method's own report. In the n-sweep the
baselines take `method.precompute_features=true` (their n features computed once rather than streamed through both
models at each of the 1000 steps; the same training data, far less CPU time) unless --sweep-streamed. Runs are kept
under --runs and skipped when their report exists with the same command on the same build of the world: an
interrupted invocation resumes, a rebuilt world runs again.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from featcal_experiments.cli_runs import COUNTS, run_fusion_bench
from featcal_fusionbench.reporting import result_header, write_results
from featcal_experiments.worlds.references import reference_accuracies
from featcal_experiments.worlds.registry import build_world, get_world, world_fingerprint

REPO = Path(__file__).resolve().parents[2]
UPSTREAMS = {
    "simple_average": "Simple Averaging",
    "ta": "Task Arithmetic",
    "adamerging": "AdaMerging (layer-wise)",
    "wudi": "WUDI",
}
CALIBRATORS = {"featcal": "FeatCal", "surgery": "Surgery", "probsurgery": "ProbSurgery"}
# AdaMerging's default of 8 loader workers only adds process start-up on these 2-core machines.
EXTRA = {"adamerging": ["method.upstream.algorithm_config.num_workers=0"]}


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
        f"Machine: {results['machine']}; date: {results['date']}; wall time of the last invocation "
        f"{results['wall_seconds'] / 60:.1f} min, which ran {results['runs']['ran']} runs and took "
        f"{results['runs']['resumed']} from earlier (interrupted) invocations.  ",
        f"World: `{results.get('world', '?')}`, world.json sha1 {results.get('world_fingerprint') or 'not recorded'} "
        "(a same-seed rebuild is not bit-identical: compare numbers from one build).  ",
        f"FeatCal settings: the paper's CLIP values (`method=featcal/clip_<upstream>`: lambda 0.05, rho 2.0, alpha 0.3), "
        f"n = {results['n']} calibration examples per task from each task's train split, seed {results['seed']}.  ",
        f"Surgery and ProbSurgery: the paper's defaults (`method=<name>/clip_<upstream>`: Adam, lr 1e-3, "
        f"{results['baseline_steps']} iterations of one step per task, batch 16, features streamed through the merged "
        "model and the expert at every step), on the same n examples per task of the train split.  ",
        "Calibration s and peak RSS come from each method's own report: the calibration stage alone, and the peak "
        "resident memory of the run's process up to the end of calibration (models, data, upstream merge included).",
        "",
        "| method | " + " | ".join(tasks) + " | average | calibration s | peak RSS GiB |",
        "|---|" + "---|" * (len(tasks) + 3),
    ]

    def row(name, accs, cost=None):
        cells = " | ".join(f"{accs[t]:.1f}" for t in [*tasks, "average"])
        extra = " | | |" if cost is None else f" | {cost['seconds']:.1f} | {cost['peak_rss_bytes'] / 2**30:.2f} |"
        return f"| {name} | {cells}{extra}"

    lines.append(row("Pretrained (zero-shot)", results["references"]["pretrained"]))
    lines.append(row("Individual experts", results["references"]["experts"]))
    for key, entry in results["mergers"].items():
        lines.append(row(UPSTREAMS[key], entry["upstream"]))
        for calibrator, calibrated in entry["calibrated"].items():
            lines.append(row(f"{UPSTREAMS[key]} + {CALIBRATORS[calibrator]}", calibrated["accuracy"], calibrated))
    sweep = results.get("sweep")
    if sweep:
        lines += [
            "",
            f"## After Task Arithmetic, against n (average accuracy; seeds {', '.join(map(str, sweep['seeds']))})",
            "",
            f"Task Arithmetic alone: {sweep['upstream_average']:.1f}; experts: "
            f"{results['references']['experts']['average']:.1f}. Baselines' features: {sweep['baseline_features']}. "
            f"Plot: `{Path(results['png']).name}`.",
            "",
            "| calibrator | n | mean | std | per seed | mean calibration s |",
            "|---|---|---|---|---|---|",
        ]
        for calibrator, by_n in sweep["averages"].items():
            for n, values in by_n.items():
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                seconds = statistics.fmean(sweep["seconds"][calibrator][n])
                lines.append(
                    f"| {CALIBRATORS[calibrator]} | {n} | {statistics.fmean(values):.1f} | {std:.1f} | "
                    f"{', '.join(f'{v:.1f}' for v in values)} | {seconds:.1f} |"
                )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["sweep"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for calibrator, by_n in sweep["averages"].items():
        ns = [int(n) for n in by_n]
        means = [statistics.fmean(v) for v in by_n.values()]
        stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in by_n.values()]
        ax.errorbar(ns, means, yerr=stds, marker="o", capsize=3, label=f"Task Arithmetic + {CALIBRATORS[calibrator]}")
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
    parser.add_argument("--calibrators", default=",".join(CALIBRATORS), help="for the merger table")
    parser.add_argument("--sweep-calibrators", default=",".join(CALIBRATORS))
    parser.add_argument("--sweep-streamed", action="store_true", help="baselines stream features in the sweep too")
    parser.add_argument("--baseline-steps", type=int, default=1000, help="Surgery / ProbSurgery iterations")
    parser.add_argument("--n", type=int, default=256, help="calibration examples per task for the merger table")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sweep-n", default="8,16,32,64,128,256", help="empty: no sweep")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--runs", type=Path, default=None, help="run folders (default outputs/world_results/SUBSET)")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default experiments/results/SUBSET)")
    args = parser.parse_args(argv)

    upstreams = [u for u in args.upstreams.split(",") if u]
    unknown = [u for u in upstreams if u not in UPSTREAMS]
    if unknown:
        parser.error(f"unknown upstream(s) {unknown}; known: {', '.join(UPSTREAMS)}")
    calibrators = [c for c in args.calibrators.split(",") if c]
    sweep_calibrators = [c for c in args.sweep_calibrators.split(",") if c]
    unknown = [c for c in calibrators + sweep_calibrators if c not in CALIBRATORS]
    if unknown or "featcal" not in calibrators:
        parser.error(f"calibrators must include featcal and come from {', '.join(CALIBRATORS)}; got unknown {unknown}")
    sweep_n = [int(n) for n in args.sweep_n.split(",") if n]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if any(n < 1 for n in [args.n, *sweep_n]):
        parser.error("every n must be at least 1")
    get_world(args.world)
    import featcal_experiments_config

    known = sorted(p.stem for p in (Path(list(featcal_experiments_config.__path__)[0]) / "modelpool" / "CLIPVisionModelPool").glob("*.yaml"))
    if args.subset not in known:
        parser.error(f"no packaged pool config {args.subset!r}; known: {', '.join(known)}")
    # absolute: each fusion_bench run starts in its own folder, where a relative path (AdaMerging's weights) breaks
    runs = (args.runs or REPO / "outputs" / "world_results" / args.subset).resolve()
    out = args.out or REPO / "experiments" / "results" / args.subset
    started = time.perf_counter()
    world_root = build_world(args.world)

    pools = [f"modelpool=CLIPVisionModelPool/{args.subset}", f"taskpool=CLIPVisionModelTaskPool/{args.subset}"]
    print("references (pretrained zero-shot, experts)", flush=True)
    refs = reference_accuracies(args.world, f"CLIPVisionModelPool/{args.subset}", f"CLIPVisionModelTaskPool/{args.subset}")
    results = {
        "subset": args.subset,
        **result_header("experiments/scripts/world_results.py", argv),
        "world": args.world,
        "world_fingerprint": world_fingerprint(args.world),
        "n": args.n,
        "seed": args.seed,
        "baseline_steps": args.baseline_steps,
        "references": {k: with_average({t: 100 * a for t, a in v.items()}) for k, v in refs.items()},
        "mergers": {},
    }
    def calibrated(report, calibrator):
        cost = report[f"{calibrator}_calibration"]
        return {"accuracy": accuracies(report[calibrator]), "seconds": cost["seconds"], "peak_rss_bytes": cost["peak_rss_bytes"]}

    for upstream in upstreams:
        entry = {"calibrated": {}}
        for calibrator in calibrators:
            print(f"{UPSTREAMS[upstream]} + {CALIBRATORS[calibrator]}", flush=True)
            extra = list(EXTRA.get(upstream, []))
            if calibrator != "featcal":
                extra.append(f"method.max_steps={args.baseline_steps}")
            if upstream == "adamerging" and calibrator != "featcal":
                extra.append(f"method.upstream.algorithm_config.weights={runs / 'adamerging' / 'merging_weights.pt'}")
            name = upstream if calibrator == "featcal" else f"{upstream}_{calibrator}"
            report = run_fusion_bench(runs / name, [
                *pools, f"method={calibrator}/clip_{upstream}", "method.return_upstream=true",
                f"method.num_calibration_examples={args.n}", f"method.seed={args.seed}", *extra,
            ], world=world_root)
            upstream_accuracy = accuracies(report["upstream"])
            if "upstream" in entry and entry["upstream"] != upstream_accuracy:
                print(f"  warning: {upstream} gave other accuracies in the {calibrator} run: {upstream_accuracy}")
            entry.setdefault("upstream", upstream_accuracy)
            entry["calibrated"][calibrator] = calibrated(report, calibrator)
        results["mergers"][upstream] = entry
    if sweep_n:
        averages, seconds, upstream_average = {}, {}, None
        for calibrator in sweep_calibrators:
            precompute = calibrator != "featcal" and not args.sweep_streamed
            for n in sweep_n:
                for seed in seeds:
                    print(f"sweep {calibrator} n={n} seed={seed}", flush=True)
                    report = run_fusion_bench(runs / f"sweep_{calibrator}_n{n}_seed{seed}", [
                        *pools, f"method={calibrator}/clip_ta", "method.return_upstream=true",
                        f"method.num_calibration_examples={n}", f"method.seed={seed}",
                        *(["method.precompute_features=true"] if precompute else []),
                        *([f"method.max_steps={args.baseline_steps}"] if calibrator != "featcal" else []),
                    ], world=world_root)
                    result = calibrated(report, calibrator)
                    averages.setdefault(calibrator, {}).setdefault(str(n), []).append(result["accuracy"]["average"])
                    seconds.setdefault(calibrator, {}).setdefault(str(n), []).append(result["seconds"])
                    upstream_average = accuracies(report["upstream"])["average"]
        results["sweep"] = {
            "seeds": seeds, "averages": averages, "seconds": seconds, "upstream_average": upstream_average,
            "baseline_features": "streamed" if args.sweep_streamed else "precomputed (method.precompute_features=true)",
        }
        results["png"] = out.with_suffix(".png").name
    results["wall_seconds"] = time.perf_counter() - started
    results["runs"] = dict(COUNTS)

    out.parent.mkdir(parents=True, exist_ok=True)
    if sweep_n:
        plot(results, out.with_suffix(".png"))
    write_results(out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
