"""Time the calibration stage of FeatCal, Surgery and ProbSurgery on one merged model.

    python experiments/scripts/bench_calibration.py --arch clip-vit-base-patch32 --tasks 8 --n 256 \
        --methods featcal,surgery,probsurgery --device cuda --json experiments/results/benchmarks/b32_cuda.json

Models have the real shapes (built from their configs with seeded random weights: cost
does not depend on the values); images are synthetic. Each method runs in a subprocess
of its own so ``peak_rss_bytes`` is that method's; each subprocess first times the
forward floor (one forward of the merged model over all tasks' samples plus each expert
over its own task's samples, as calibration needs them) so every ratio is measured in
one process. Only the calibration stage is timed: not the model construction, the
upstream merge or any evaluation.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

from featcal_experiments.python_processes import run_python
from featcal_fusionbench.integration.memory import peak_rss_bytes
from featcal_fusionbench.integration.reporting import machine_line

ARCHS = {
    # CLIPVisionConfig's defaults are ViT-B/32.
    "clip-vit-base-patch32": dict(),
    "clip-vit-large-patch14": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        patch_size=14, projection_dim=768,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        image_size=32, patch_size=8, projection_dim=32,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
        image_size=64, patch_size=8, projection_dim=128,
    ),
}


def build(arch: str, tasks: int, n: int, seed: int = 0, noise_device: str = "cpu"):
    """Base, experts (base + small seeded noise), their Task Arithmetic merge (0.3) and synthetic images.
    ``noise_device="cuda"`` draws the noise there (ViT-L/14 with 20 experts draws 6e9 numbers)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(**ARCHS[arch])
    base = CLIPVisionModel(config).eval()
    names = [f"task{i}" for i in range(tasks)]
    experts, state = {}, base.state_dict()
    merged = copy.deepcopy(base)
    merged_state = {k: v.clone() for k, v in state.items()}
    for i, name in enumerate(names):
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for k, p in expert.state_dict().items():
                delta = 1e-3 * torch.randn(p.shape, dtype=p.dtype, device=noise_device).cpu()
                p.add_(delta)
                merged_state[k] += 0.3 * delta
        experts[name] = expert
    merged.load_state_dict(merged_state)
    generator = torch.Generator().manual_seed(seed + 1)
    size = config.image_size
    images = {t: torch.randn(n, 3, size, size, generator=generator) for t in names}
    return config, base, merged, experts, images


def batches(tensor, batch_size):
    return [tensor[i : i + batch_size] for i in range(0, len(tensor), batch_size)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def forward_floor(merged, experts, images, batch_size, device) -> float:
    """Merged model over every task's samples, each expert over its own task's; models on the device."""
    merged = merged.to(device)
    # warm-up outside the timing: CUDA context, kernel loading and library handles would otherwise be charged to
    # the floor (and flatter every ratio)
    warm = next(iter(images.values()))[:batch_size].to(device)
    merged(pixel_values=warm)
    sync(device)
    started = time.perf_counter()
    for task, expert in experts.items():
        expert.to(device)
        for x in batches(images[task], batch_size):
            x = x.to(device)
            merged(pixel_values=x)
            expert(pixel_values=x)
        expert.to("cpu")
    sync(device)
    seconds = time.perf_counter() - started
    merged.to("cpu")
    return seconds


def run_featcal(args, config, base, merged, experts, images, device):
    from featcal_fusionbench.families.clip_vision import CLIPVisionFamily
    from featcal_fusionbench.engine.loop import FeatCalEngine
    from featcal_fusionbench.core.hparams import FeatCalHParams

    hp = FeatCalHParams(num_calibration_examples=args.n, batch_size=args.batch_size)
    engine = FeatCalEngine(
        CLIPVisionFamily(), hp, device, track_upstream=args.track_upstream_drift, progress=False,
        profile=args.profile,
    )
    task_batches = {t: iter(batches(images[t], args.batch_size)) for t in experts}
    sync(device)
    started = time.perf_counter()
    report = engine.run(merged, base, experts, task_batches)
    sync(device)
    return time.perf_counter() - started, {
        "phase_seconds": report["phase_seconds"],
        "statistics_bytes": report["statistics_bytes"],
    }


def tensor_family_and_site(config, device):
    """The CLIP family over a tensor of images instead of a dataset (seeded shuffled batches, recycled, as
    the calibration loader gives them), and its feature site (projected, normalised image embedding)."""
    from featcal_fusionbench.families.clip_vision import CLIPImageFeatureSite, CLIPVisionFamily

    class TensorFamily(CLIPVisionFamily):
        def batches(self, modelpool, images, batch_size, shuffle=False, seed=0):
            generator = torch.Generator().manual_seed(seed)
            while True:
                yield from batches(images[torch.randperm(len(images), generator=generator)], batch_size)

    class TensorSite(CLIPImageFeatureSite):
        def __init__(self, projection):
            self.projection, self.dim = projection, projection.out_features

    torch.manual_seed(0)
    projection = torch.nn.Linear(config.hidden_size, config.projection_dim, bias=False)
    return TensorFamily(), TensorSite(projection.requires_grad_(False)).to(device)


def run_surgery(args, config, base, merged, experts, images, device, cls, steps=None):
    """The baseline's own training loop (``train``) for ``steps`` iterations on streamed features."""
    import lightning as L

    steps = args.surgery_steps if steps is None else steps
    algo = cls(max_steps=steps, batch_size=16, num_calibration_examples=args.n)
    algo._fabric_instance = L.Fabric(accelerator=device.type, devices=1)
    family, site = tensor_family_and_site(config, device)
    tasks = list(experts)
    wrapper = algo.build_wrapper(copy.deepcopy(merged), tasks, site.dim).to(device)
    for expert in experts.values():
        expert.requires_grad_(False).to(device)
    sync(device)
    started = time.perf_counter()
    streams = {
        t: algo.feature_stream(family, site, None, wrapper.model, experts[t], images[t], i) for i, t in enumerate(tasks)
    }
    algo.train(wrapper, streams)
    sync(device)
    seconds = time.perf_counter() - started
    for expert in experts.values():
        expert.to("cpu")
    per_step = seconds / max(steps, 1)
    return seconds, {
        "steps": steps,
        "seconds_per_step": per_step,
        "extrapolated_seconds_1000_steps": per_step * 1000,
    }


class RSSSampler:
    """Peak resident memory over a region, sampled: the process's peak cannot be reset after the models are built."""

    def __init__(self, interval: float = 0.01):
        import threading

        import psutil

        self.process, self.interval = psutil.Process(), interval
        self.start_bytes = self.peak_bytes = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)


def model_bytes(*models) -> int:
    return sum(p.numel() * p.element_size() for m in models for p in m.parameters())


def stage_figures(seconds: float, floor: float, rss: "RSSSampler", device: torch.device) -> dict:
    """Time against the forward floor, and memory: the process's peak, and what the timed stage itself holds
    (resident at its start: interpreter, CUDA context, the models and data the bench built; the sampled peak while
    it runs)."""
    return {
        "seconds": seconds,
        "forward_floor_seconds": floor,
        "ratio_to_floor": seconds / floor,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_at_start_bytes": rss.start_bytes,
        "peak_rss_during_bytes": rss.peak_bytes,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    }


def worker(args) -> dict:
    from featcal_fusionbench.baselines import ProbSurgeryAlgorithm, SurgeryAlgorithm

    device = torch.device(args.device)
    config, base, merged, experts, images = build(args.arch, args.tasks, args.n)
    floor = forward_floor(merged, experts, images, args.batch_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with RSSSampler() as rss:
        if args.worker == "featcal":
            seconds, extra = run_featcal(args, config, base, merged, experts, images, device)
        else:
            cls = SurgeryAlgorithm if args.worker == "surgery" else ProbSurgeryAlgorithm
            seconds, extra = run_surgery(args, config, base, merged, experts, images, device, cls)
    return {
        "method": args.worker,
        **stage_figures(seconds, floor, rss, device),
        "models_bytes": model_bytes(base, merged, *experts.values()),
        **extra,
    }


def in_subprocess(script: str, worker_key: str) -> dict:
    """Run ``script`` again with ``--worker worker_key`` (a fresh process: its own peak RSS and device memory;
    forked under the tests, featcal_experiments/python_processes.py) and return the result it prints; exit with its
    stderr if it fails."""
    out = run_python([script, *sys.argv[1:], "--worker", worker_key])
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"{worker_key} failed:\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def provenance(script: str, device: str) -> dict:
    return {
        "command": "python " + " ".join([os.path.relpath(script)] + sys.argv[1:]),
        "date": date.today().isoformat(),
        "machine": machine_line() + (f", {torch.cuda.get_device_name()}" if device == "cuda" else ""),
        "torch": torch.__version__,
    }


def write_json(path: str, data) -> None:
    from featcal_experiments.cli_runs import write_json_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(Path(path), data)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="clip-vit-base-patch32")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--n", type=int, default=256, help="calibration examples per task")
    parser.add_argument("--methods", default="featcal,surgery,probsurgery")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--surgery-steps", type=int, default=1000, help="iterations timed for Surgery/ProbSurgery")
    parser.add_argument(
        "--track-upstream-drift", action="store_true",
        help="FeatCal also advances the upstream model's trajectory (method option track_upstream_drift)",
    )
    parser.add_argument("--profile", action="store_true", help="FeatCal per-phase seconds")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tasks < 1 or args.n < 1:
        parser.error("--tasks and --n must be >= 1")
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - {"featcal", "surgery", "probsurgery"}
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")

    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    results = []
    for method in methods:
        result = in_subprocess(__file__, method)
        results.append(result)
        print(
            f"{method:12s} {result['seconds']:9.2f} s  floor {result['forward_floor_seconds']:8.2f} s  "
            f"x{result['ratio_to_floor']:6.2f}  peak RSS {result['peak_rss_bytes'] / 2**30:6.2f} GiB"
            + (f"  peak device {result['peak_device_bytes'] / 2**30:6.2f} GiB" if result["peak_device_bytes"] else "")
            + f"  [RSS {result['rss_at_start_bytes'] / 2**30:.2f} -> {result['peak_rss_during_bytes'] / 2**30:.2f} GiB"
            f" during; models {result['models_bytes'] / 2**30:.2f} GiB]"
            + (f"  ({result['steps']} steps, {result['extrapolated_seconds_1000_steps']:.1f} s per 1000)" if "steps" in result else "")
        )
        if result.get("statistics_bytes"):
            print(f"  statistics (one task's moments + a block's sums): {result['statistics_bytes'] / 2**20:.1f} MiB")
        if result.get("phase_seconds"):
            print("  " + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(result["phase_seconds"].items(), key=lambda kv: -kv[1])))
    summary = {
        **provenance(__file__, args.device),
        "arch": args.arch, "tasks": args.tasks, "n": args.n, "device": args.device,
        "results": results,
    }
    if args.json:
        write_json(args.json, summary)


if __name__ == "__main__":
    main()
