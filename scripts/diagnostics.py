"""The paper's diagnostics, each one command that writes JSON and a PNG (issue: reproduce the paper's tables).

  python scripts/diagnostics.py features     # Fig. 1 per-block drift to the experts, TA vs + FeatCal, and
                                             # Fig. 2a final-feature cosine per task for TA, + Surgery, + FeatCal
Options: --world offline (default: the offline CLIP world, offline_clip8), hub (FusionBench's ViT-B/32 TA8 pools) or
toy (the synthetic smoke world);
--out (default docs/diagnostics/<world>); -n examples per task (256); --surgery-steps (1000, the paper's);
--test-examples (cap per task on the test images compared; default all).
Every output names its command, machine and date.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def load_pool_configs(world: str):
    if world in WORLDS:
        from featcal_fusionbench.worlds.registry import build_world, pool_configs

        build_world(WORLDS[world])
        return pool_configs(WORLDS[world])
    import fusion_bench_config
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        cfg = compose("fabric_model_fusion", overrides=[f"modelpool={HUB_POOLS[0]}", f"taskpool={HUB_POOLS[1]}"])
    return cfg.modelpool, cfg.taskpool


def method_config(name: str) -> dict:
    """A packaged method config's constructor arguments (the paper's values live there, once)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "config" / "method" / f"{name}.yaml"), resolve=True)
    cfg.pop("_target_")
    cfg.pop("upstream")
    return cfg


def features(args) -> None:
    import lightning as L
    import torch
    from fusion_bench.method import TaskArithmeticAlgorithm
    from fusion_bench.utils import instantiate

    from featcal_fusionbench import FeatCalAlgorithm, SurgeryAlgorithm
    from featcal_fusionbench.baselines.sites import CLIPImageFeatureSite
    from featcal_fusionbench.data import calibration_indices
    from featcal_fusionbench.diagnostics import (
        FixedUpstream, block_drift, final_feature_cosine, load_report, plot_cosine, plot_drift, write_json,
    )

    out = Path(args.out or REPO / "docs" / "diagnostics" / args.world)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pool = instantiate(load_pool_configs(args.world)[0])
    tasks = list(pool.model_names)
    fabric = L.Fabric(accelerator="auto", devices=1, loggers=[L.fabric.loggers.CSVLogger(str(out / "logs"))])
    merged = TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(pool)
    upstream = FixedUpstream(merged, "Task Arithmetic (0.3)")

    def calibrate(cls, config, **overrides):
        method = cls(**{**method_config(config), **overrides, "upstream": upstream})
        method._fabric_instance = fabric
        seconds = time.perf_counter()
        model = method.run(pool)
        return model, time.perf_counter() - seconds

    n = args.n
    featcal, featcal_s = calibrate(FeatCalAlgorithm, "featcal/clip_ta", num_calibration_examples=n, track_upstream_drift=True)
    surgery, surgery_s = calibrate(SurgeryAlgorithm, "surgery/clip_ta", num_calibration_examples=n, max_steps=args.surgery_steps)
    report = load_report(out / "logs", "featcal_report.json")
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
        CLIPImageFeatureSite(pool), {"Task Arithmetic": merged, "+ Surgery": surgery, "+ FeatCal": featcal},
        experts, test_sets, device,
    )
    provenance = {
        "command": "python scripts/diagnostics.py " + shlex.join(args.argv),
        "machine": machine(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world": args.world,
        "calibration_examples_per_task": n,
        "surgery_steps": args.surgery_steps,
        "seconds": {"featcal": featcal_s, "surgery": surgery_s, "total": time.perf_counter() - started},
        "test_examples_per_task": {t: len(d) for t, d in test_sets.items()},
    }
    write_json(out / "drift.json", {**provenance, "drift": drift})
    write_json(out / "cosine.json", {**provenance, "cosine": cosine})
    stamp = f"{provenance['command']} | {provenance['date']}"
    plot_drift(drift, out / "drift.png", f"Per-block feature drift to the experts (thin: tasks)\n{stamp}")
    plot_cosine(cosine, out / "cosine.png", f"Final-feature cosine to the expert\n{stamp}")
    for name, per_task in cosine.items():
        print(f"{name:18s} " + " ".join(f"{t}={v:.3f}" for t, v in per_task.items()))
    print(f"wrote {out}/drift.{{json,png}} and cosine.{{json,png}} in {provenance['seconds']['total']:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    feat = sub.add_parser("features", help="Fig. 1 drift per block and Fig. 2a final-feature cosine")
    feat.add_argument("--world", choices=(*WORLDS, "hub"), default="offline")
    feat.add_argument("--out", default=None)
    feat.add_argument("-n", type=int, default=256, help="calibration examples per task")
    feat.add_argument("--surgery-steps", type=int, default=1000)
    feat.add_argument("--test-examples", type=int, default=0, help="cap on test images per task (0: all)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "features":
        if args.n < 1 or args.surgery_steps < 0 or args.test_examples < 0:
            parser.error("-n must be >= 1, --surgery-steps and --test-examples >= 0")
        features(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
