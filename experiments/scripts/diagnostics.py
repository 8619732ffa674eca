"""The paper's diagnostics, each one command that writes JSON and a PNG (issue: reproduce the paper's tables).

  python experiments/scripts/diagnostics.py features     # Fig. 1 per-block drift to the experts, TA vs + FeatCal, and
                                             # Fig. 2a final-feature cosine per task for TA, + Surgery, + FeatCal
  python experiments/scripts/diagnostics.py corruption   # Table 6: calibration data corrupted (ImageNet-C severity 3), clean tests
  python experiments/scripts/diagnostics.py sweep        # Fig. 5: single-factor lambda / rho / alpha sweeps (Hydra multirun)
                                             # after Task Arithmetic and WUDI, each merged once and reused
The sample-budget sweep (Table 12, Fig. 3) is a table of the runner: `python experiments/scripts/reproduce.py --table 12`.
Runs go through the `fusion_bench` CLI in folders under --runs, cached by command (an interrupted invocation resumes).
Options: --world offline (default: the offline CLIP world, offline_clip8), hub (FusionBench's ViT-B/32 TA8 pools) or
toy (the synthetic smoke world);
--out (default experiments/results/diagnostics/<world>); --runs (default outputs/diagnostics/<world>/<command>); -n examples per
task (256); --surgery-steps (1000, the paper's);
--test-examples (cap per task on the test images compared; default all).
Every output names its command, machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HUB_POOLS = ("CLIPVisionModelPool/clip-vit-base-patch32_TA8", "CLIPVisionModelTaskPool/clip-vit-classification_TA8")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, torch {torch.__version__}"


WORLDS = {"offline": "clip", "toy": "toy"}  # --world -> offline world (toy: seconds to build, for smoke tests)


def built_world(args):
    """The root of the offline world the runs read (whose build a kept run must match); None for the hub."""
    if args.world not in WORLDS:
        return None
    from featcal_experiments.worlds.registry import world_path

    return world_path(WORLDS[args.world])


def load_pool_configs(world: str):
    from featcal_experiments.worlds.registry import build_world, compose_pools, pool_configs

    if world in WORLDS:
        build_world(WORLDS[world])
        return pool_configs(WORLDS[world])
    return compose_pools(*HUB_POOLS)


def method_config(name: str) -> dict:
    """A packaged method config's constructor arguments, composed as the CLI composes them (the paper's values live
    there, once)."""
    from omegaconf import OmegaConf

    from featcal_experiments.worlds.registry import compose_cli

    cfg = OmegaConf.to_container(compose_cli([f"method={name}"]).method, resolve=True)
    cfg.pop("_target_")
    cfg.pop("upstream")
    return cfg


def features(args) -> None:
    import lightning as L
    from fusion_bench.method import TaskArithmeticAlgorithm
    from fusion_bench.utils import instantiate

    from featcal_fusionbench import FeatCalAlgorithm, SurgeryAlgorithm
    from featcal_experiments.cli_runs import write_json_atomic
    from featcal_fusionbench.core.sampling import calibration_indices
    from featcal_experiments.diagnostics import (
        FixedUpstream, block_drift, final_feature_cosine, load_report, plot_drift, plot_groups,
    )

    out, runs = folders(args, "features")
    shutil.rmtree(runs / "logs", ignore_errors=True)  # this invocation's FeatCal report is the one read back
    started = time.perf_counter()
    pool = instantiate(load_pool_configs(args.world)[0])
    tasks = list(pool.model_names)
    fabric = L.Fabric(accelerator="auto", devices=1, loggers=[L.fabric.loggers.CSVLogger(str(runs / "logs"))])
    merged = TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(pool)
    upstream = FixedUpstream(merged)

    def calibrate(cls, config, **overrides):
        method = cls(**{**method_config(config), **overrides, "upstream": upstream})
        method._fabric_instance = fabric
        seconds = time.perf_counter()
        model = method.run(pool)
        return model, time.perf_counter() - seconds

    n = args.n
    featcal, featcal_s = calibrate(FeatCalAlgorithm, "featcal/clip_ta", num_calibration_examples=n, track_upstream_drift=True)
    surgery, surgery_s = calibrate(SurgeryAlgorithm, "surgery/clip_ta", num_calibration_examples=n, max_steps=args.surgery_steps)
    report = load_report(runs / "logs", "featcal_report.json")
    drift = block_drift(report)

    experts = {t: pool.load_model(t) for t in tasks}
    test_sets = {}
    for task in tasks:
        dataset = pool.load_test_dataset(task)
        if args.test_examples and len(dataset) > args.test_examples:
            dataset = dataset.select(calibration_indices(len(dataset), args.test_examples, 0, task))
        test_sets[task] = dataset
    device = fabric.device
    cosine = final_feature_cosine(
        pool, {"Task Arithmetic": merged, "+ Surgery": surgery, "+ FeatCal": featcal},
        experts, test_sets, device,
    )
    header = {
        **provenance(args, started),
        "calibration_examples_per_task": n,
        "surgery_steps": args.surgery_steps,
        "seconds": {"featcal": featcal_s, "surgery": surgery_s, "total": time.perf_counter() - started},
        "test_examples_per_task": {t: len(d) for t, d in test_sets.items()},
    }
    write_json_atomic(out / "drift.json", {**header, "drift": drift})
    write_json_atomic(out / "cosine.json", {**header, "cosine": cosine})
    stamp = f"{header['command']} | {header['date']}"
    plot_drift(drift, out / "drift.png", f"Per-block feature drift to the experts (thin: tasks)\n{stamp}")
    plot_groups(cosine, out / "cosine.png", "final-feature cosine to the expert", f"Final-feature cosine per task\n{stamp}")
    for name, per_task in cosine.items():
        print(f"{name:18s} " + " ".join(f"{t}={v:.3f}" for t, v in per_task.items()))
    print(f"wrote {out}/drift.{{json,png}} and cosine.{{json,png}} in {header['seconds']['total']:.0f} s")


def provenance(args, started: float) -> dict:
    from featcal_experiments.worlds.registry import world_fingerprint

    return {
        "command": "python experiments/scripts/diagnostics.py " + shlex.join(args.argv),
        "machine": machine(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world": args.world,
        "world_fingerprint": world_fingerprint(WORLDS[args.world]) if args.world in WORLDS else None,
        "seconds": time.perf_counter() - started,
    }


def pool_args(args) -> list:
    if args.world == "hub":
        return [f"modelpool={HUB_POOLS[0]}", f"taskpool={HUB_POOLS[1]}"]
    from featcal_experiments.worlds.registry import build_world, fusion_bench_args

    build_world(WORLDS[args.world])
    return fusion_bench_args(WORLDS[args.world])


def average_accuracy(section: dict) -> float:
    return 100 * section["average"]["accuracy"]


def corruption_override(tasks, corruption: str, severity: int) -> str:
    """Every task's calibration examples: its train split (as the pool defines it), corrupted."""
    entries = ",".join(
        f"{t}:{{_target_:featcal_experiments.corruptions.CorruptedImageDataset,corruption:{corruption},"
        f"severity:{severity},dataset:${{modelpool.train_datasets.{t}}}}}"
        for t in tasks
    )
    return f"+method.calibration_datasets={{{entries}}}"


def corruption(args) -> None:
    from featcal_experiments.cli_runs import run_fusion_bench, write_json_atomic
    from featcal_experiments.diagnostics import plot_groups

    started = time.perf_counter()
    tasks = list(load_pool_configs(args.world)[0].models)
    tasks.remove("_pretrained_")
    out, runs = folders(args, "corruption")
    results: dict = {"accuracy": {}, "calibration_seconds": {}}
    for calibrator in args.calibrators.split(","):
        for name in args.corruptions.split(","):
            print(f"{calibrator} calibrated on {name}", flush=True)
            report = run_fusion_bench(runs / f"{calibrator}_{name}", [
                *pool_args(args), f"method={calibrator}/clip_ta", "method.return_upstream=true",
                f"method.num_calibration_examples={args.n}",
                *([f"method.max_steps={args.surgery_steps}"] if calibrator != "featcal" else []),
                *([corruption_override(tasks, name, args.severity)] if name != "clean" else []),
            ], offline=args.world != "hub", world=built_world(args))
            results["accuracy"].setdefault(calibrator, {})[name] = average_accuracy(report[calibrator])
            calibration = report[f"{calibrator}_calibration"]
            results["calibration_seconds"].setdefault(calibrator, {})[name] = calibration["seconds"]
            results.setdefault("calibration_data", {}).setdefault(calibrator, {})[name] = calibration.get("calibration_data")
            results["upstream"] = average_accuracy(report["upstream"])
    for per in results["accuracy"].values():
        per["average"] = sum(per.values()) / len(per)
    payload = {**provenance(args, started), "n": args.n, "severity": args.severity, **results}
    write_json_atomic(out / "corruption.json", payload)
    plot_groups(results["accuracy"], out / "corruption.png", "average accuracy (%), clean test sets",
                f"Calibration data corrupted (severity {args.severity}); Task Arithmetic {results['upstream']:.1f}\n"
                f"{payload['command']} | {payload['date']}", reference=results["upstream"])
    print(json.dumps(results["accuracy"], indent=1))


SWEEP_UPSTREAMS = {
    "ta": ["method=task_arithmetic", "method.scaling_factor=0.3"],
    "wudi": ["method=wudi/wudi"],
}


def sweep(args) -> None:
    from featcal_experiments.cli_runs import run_fusion_bench, write_json_atomic
    from featcal_experiments.diagnostics import plot_sweeps

    started = time.perf_counter()
    out, runs = folders(args, "sweep")
    grids = {"lambda_": args.grid_lambda, "rho": args.grid_rho, "alpha": args.grid_alpha}
    results: dict = {"upstream": {}, "featcal": {}}
    for upstream in args.upstreams.split(","):
        merged = runs / f"merged_{upstream}"
        print(f"{upstream}: merge once", flush=True)
        report = run_fusion_bench(runs / f"upstream_{upstream}", [
            *pool_args(args), *SWEEP_UPSTREAMS[upstream], f"merged_model_save_path={merged}",
        ], offline=args.world != "hub", world=built_world(args))
        results["upstream"][upstream] = average_accuracy(report)
        for factor, grid in grids.items():
            values = [float(v) for v in grid.split(",") if v]
            if not values:
                continue
            print(f"{upstream}: FeatCal {factor} in {values}", flush=True)
            reports = run_fusion_bench(runs / f"{upstream}_{factor}", [
                *pool_args(args), f"method=featcal/clip_{upstream}", f"method.merged_model_path={merged}",
                f"method.num_calibration_examples={args.n}", f"method.{factor}={','.join(map(str, values))}",
            ], jobs=len(values), offline=args.world != "hub", world=built_world(args))
            results["featcal"].setdefault(upstream, {})[factor] = {
                "values": values, "accuracy": [average_accuracy(r) for r in reports],
            }
    payload = {**provenance(args, started), "n": args.n, "defaults": "paper: lambda 0.05, rho 2.0, alpha 0.3", **results}
    write_json_atomic(out / "sweep.json", payload)
    plot_sweeps(results, out / "sweep.png", f"FeatCal single-factor sweeps (others at the paper's values)\n"
                f"{payload['command']} | {payload['date']}")
    print(json.dumps(results, indent=1))


def folders(args, name: str):
    out = Path(args.out or REPO / "experiments" / "results" / "diagnostics" / args.world)
    # absolute: each fusion_bench run starts in its own folder, where a relative path (the saved merged model) breaks
    runs = Path(args.runs or REPO / "outputs" / "diagnostics" / args.world / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out, runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    feat = sub.add_parser("features", help="Fig. 1 drift per block and Fig. 2a final-feature cosine")
    feat.add_argument("--surgery-steps", type=int, default=1000)
    feat.add_argument("--test-examples", type=int, default=0, help="cap on test images per task (0: all)")
    corr = sub.add_parser("corruption", help="Table 6: calibration on corrupted images, clean evaluation")
    corr.add_argument("--calibrators", default="featcal,surgery,probsurgery")
    corr.add_argument("--corruptions", default="clean,gaussian_noise,motion_blur,fog")
    corr.add_argument("--severity", type=int, default=3)
    corr.add_argument("--surgery-steps", type=int, default=1000)
    swp = sub.add_parser("sweep", help="Fig. 5: single-factor lambda / rho / alpha sweeps")
    swp.add_argument("--upstreams", default="ta,wudi")
    swp.add_argument("--grid-lambda", default="0.0001,0.001,0.01,0.05,0.1,0.5,1,10")
    swp.add_argument("--grid-rho", default="0,0.5,1,1.5,2,2.5,3,4")
    swp.add_argument("--grid-alpha", default="0,0.1,0.2,0.3,0.5,0.7,0.9,1")
    for command in (feat, corr, swp):
        command.add_argument("--world", choices=(*WORLDS, "hub"), default="offline")
        command.add_argument("--out", default=None)
        command.add_argument("--runs", default=None, help="run folders (default outputs/diagnostics/<world>/<command>)")
        command.add_argument("-n", type=int, default=256, help="calibration examples per task")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.n < 1:
        parser.error("-n must be >= 1")
    if args.command == "features":
        if args.surgery_steps < 0 or args.test_examples < 0:
            parser.error("--surgery-steps and --test-examples must be >= 0")
        features(args)
    elif args.command == "corruption":
        from featcal_experiments.corruptions import check_severity

        from featcal_experiments.corruptions import CORRUPTIONS

        unknown = [c for c in args.calibrators.split(",") if c not in ("featcal", "surgery", "probsurgery")]
        if unknown:
            parser.error(f"unknown calibrator(s) {unknown}; known: featcal, surgery, probsurgery")
        unknown = [c for c in args.corruptions.split(",") if c not in ("clean", *CORRUPTIONS)]
        if unknown:
            parser.error(f"unknown corruption(s) {unknown}; known: clean, {', '.join(CORRUPTIONS)}")
        try:
            check_severity(args.severity)
        except ValueError as err:
            parser.error(str(err))
        corruption(args)
    else:
        unknown = [u for u in args.upstreams.split(",") if u not in SWEEP_UPSTREAMS]
        if unknown:
            parser.error(f"unknown upstream(s) {unknown}; known: {', '.join(SWEEP_UPSTREAMS)}")
        for name in ("grid_lambda", "grid_rho", "grid_alpha"):
            try:
                [float(v) for v in getattr(args, name).split(",") if v]
            except ValueError:
                parser.error(f"--{name.replace('_', '-')} must be comma-separated numbers, got {getattr(args, name)!r}")
        sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
