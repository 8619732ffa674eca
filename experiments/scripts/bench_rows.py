"""Time, on one device, what each row of the paper's CLIP tables spends its time on, for every setting.

    python experiments/scripts/bench_rows.py --settings b32-8,b32-14,b32-20,l14-8,l14-14,l14-20 --device cuda \
        --json experiments/results/benchmarks/rows_cuda.json

Per setting (architecture and number of tasks), in a subprocess of its own, on models of the real shapes with
seeded random weights and synthetic images (cost does not depend on the values):

- ``eval``: the merged model's images per second at FusionBench's evaluation batch size (128), and one CPU
  worker's CLIP preprocessing rate (``CLIPImageProcessor`` on 500x375 RGB images, a typical photo size);
- ``featcal``: the whole calibration at the paper's n (256 per task);
- ``surgery``, ``probsurgery``: the baselines' own training loop at two step counts, then fixed + per-step cost,
  and the cost of their default 1000 steps;
- ``adamerging``: FusionBench's ``LayerWiseMergedModel`` in FusionBench's test-time adaptation loop (entropy of
  zero-shot logits, one backward per task, Adam step, re-merge) at two step counts, extrapolated to its 1000;
- ``wudi``: FusionBench's ``wudi_merging`` at two iteration counts, extrapolated to the paper's 400.

``featcal_experiments.reproduce.estimate`` turns the JSON into per-table times (``experiments/scripts/estimate_tables.py``).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_calibration import (  # noqa: E402
    batches, build, in_subprocess, provenance, run_featcal, run_surgery, sync, write_json,
)

ARCH_KEYS = {"b32": "clip-vit-base-patch32", "l14": "clip-vit-large-patch14", "tiny": "tiny"}
EVAL_BATCH = 128  # FusionBench's CLIP task pool (dataloader_kwargs.batch_size)
ADAMERGING_STEPS, SURGERY_STEPS, WUDI_ITERS = 1000, 1000, 400  # FusionBench's / this plugin's / the paper's


def parse_setting(text: str):
    arch, _, tasks = text.partition("-")
    if arch not in ARCH_KEYS or not tasks.isdigit() or int(tasks) < 1:
        raise ValueError(f"setting {text!r}: expected <{'|'.join(ARCH_KEYS)}>-<tasks>, e.g. b32-8")
    return ARCH_KEYS[arch], int(tasks)


def two_point(run, low: int, high: int, target: int) -> dict:
    """``run(k)`` seconds at two counts -> fixed cost, cost per step, and the cost at ``target`` steps
    (warm-up and set-up land in the fixed part instead of inflating the per-step figure)."""
    t_low, t_high = run(low), run(high)
    per_step = max(t_high - t_low, 0.0) / (high - low)
    fixed = max(t_low - low * per_step, 0.0)
    return {"steps": [low, high], "seconds": [t_low, t_high], "fixed_seconds": fixed,
            "seconds_per_step": per_step, "target_steps": target, "seconds_at_target": fixed + target * per_step}


@torch.no_grad()
def eval_rate(merged, config, device, num_batches: int) -> float:
    """Images per second of the merged model with a zero-shot head, as the task pool evaluates it."""
    merged = merged.to(device).eval()
    projection = torch.nn.Linear(config.hidden_size, config.projection_dim, bias=False).to(device)
    text = torch.nn.functional.normalize(torch.randn(100, config.projection_dim, device=device), dim=-1)
    x = torch.randn(EVAL_BATCH, 3, config.image_size, config.image_size, device=device)

    def step():
        embeds = torch.nn.functional.normalize(projection(merged(pixel_values=x)[1]), dim=-1)
        return (100 * embeds @ text.T).argmax(-1)

    for _ in range(2):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(num_batches):
        step()
    sync(device)
    rate = num_batches * EVAL_BATCH / (time.perf_counter() - started)
    merged.to("cpu")
    return rate


def preprocess_rate(config, count: int = 64) -> float:
    """One CPU worker's CLIP preprocessing (resize, centre crop, normalise) of decoded photos, images/s."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": config.image_size},
                                   crop_size={"height": config.image_size, "width": config.image_size})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)) for _ in range(8)]
    torch.set_num_threads(1)
    started = time.perf_counter()
    for i in range(count):
        processor(images=images[i % len(images)], return_tensors="pt")
    seconds = time.perf_counter() - started
    torch.set_num_threads(os.cpu_count() or 1)
    return count / seconds


def adamerging_seconds(base, experts, images, config, device, steps: int) -> float:
    """FusionBench's layer-wise AdaMerging wrapper and test-time adaptation loop, ``steps`` iterations."""
    from fusion_bench.method.adamerging.entropy_loss import entropy_loss
    from fusion_bench.models.wrappers.layer_wise_fusion import LayerWiseMergedModel, get_layer_wise_weights

    sync(device)
    started = time.perf_counter()
    pretrained = copy.deepcopy(base)
    finetuned = [copy.deepcopy(e) for e in experts.values()]
    weights = get_layer_wise_weights(
        num_models=len(finetuned), num_layers=sum(1 for p in pretrained.parameters() if p.requires_grad),
        init_values=0.3,
    )
    module = LayerWiseMergedModel(weights, pretrained, finetuned, clamp_weights=False, tie_weights=True,
                                  strict=False).to(device)
    optimizer = torch.optim.Adam([module.merge_weight], lr=1e-3)
    projection = torch.nn.Linear(config.hidden_size, config.projection_dim, bias=False).to(device)
    projection.requires_grad_(False)
    heads = {t: torch.nn.functional.normalize(torch.randn(100, config.projection_dim, device=device), dim=-1)
             for t in experts}
    streams = {t: itertools.cycle(batches(images[t], 16)) for t in experts}
    module.train()
    module.merge_weights()
    for _ in range(steps):
        for task in experts:
            x = next(streams[task]).to(device)
            embeds = torch.nn.functional.normalize(projection(module(pixel_values=x)[1]), dim=-1)
            entropy_loss(100 * embeds @ heads[task].T).backward(retain_graph=True)
        optimizer.step()
        optimizer.zero_grad()
        module.merge_weights()
    sync(device)
    seconds = time.perf_counter() - started
    del module
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def wudi_seconds(base, experts, device, iterations: int) -> float:
    """FusionBench's WUDI-Merging (``wudi_merging``) on the experts' task vectors, ``iterations`` per matrix."""
    import contextlib
    import io

    from fusion_bench.method.wudi.wudi import wudi_merging

    base_state = base.state_dict()
    vectors = [{k: v - base_state[k] for k, v in e.state_dict().items()} for e in experts.values()]
    sync(device)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints every key
        wudi_merging(vectors, accelerator=device, iter_num=iterations)
    sync(device)
    return time.perf_counter() - started


def worker(args) -> dict:
    from featcal_fusionbench.baselines import ProbSurgeryAlgorithm, SurgeryAlgorithm

    arch, tasks = parse_setting(args.worker)
    device = torch.device(args.device)
    started = time.perf_counter()
    config, base, merged, experts, images = build(arch, tasks, args.n, noise_device=args.device)
    out = {"setting": args.worker, "arch": arch, "tasks": tasks, "n": args.n,
           "build_seconds": time.perf_counter() - started}
    out["eval_images_per_second"] = eval_rate(merged, config, device, args.eval_batches)
    out["preprocess_images_per_second_per_worker"] = preprocess_rate(config)
    options = SimpleNamespace(n=args.n, batch_size=16, track_upstream_drift=False, profile=False)
    out["featcal_seconds"] = run_featcal(options, config, base, copy.deepcopy(merged), experts, images, device)[0]
    low, high = args.steps
    for name, cls in (("surgery", SurgeryAlgorithm), ("probsurgery", ProbSurgeryAlgorithm)):
        out[name] = two_point(
            lambda k: run_surgery(options, config, base, merged, experts, images, device, cls, steps=k)[0],
            low, high, SURGERY_STEPS)
    out["adamerging"] = two_point(
        lambda k: adamerging_seconds(base, experts, images, config, device, k), low, high, ADAMERGING_STEPS)
    out["wudi"] = two_point(lambda k: wudi_seconds(base, experts, device, k), low, high, WUDI_ITERS)
    out["peak_device_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="b32-8,b32-14,b32-20,l14-8,l14-14,l14-20",
                        help="comma-separated <arch>-<tasks>; arch in " + ", ".join(ARCH_KEYS))
    parser.add_argument("--n", type=int, default=256, help="calibration examples per task")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", default="2,6", help="the two step counts of the extrapolated methods")
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument("--json", help="write the results here (after every setting)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        settings = [s for s in args.settings.split(",") if s]
        for s in settings:
            parse_setting(s)
        args.steps = tuple(int(k) for k in args.steps.split(","))
    except ValueError as e:
        parser.error(str(e))
    if len(args.steps) != 2 or not 0 < args.steps[0] < args.steps[1]:
        parser.error("--steps takes two increasing positive counts, e.g. 2,6")
    if args.n < 1 or args.eval_batches < 1:
        parser.error("--n and --eval-batches must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")

    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    summary = {**provenance(__file__, args.device), "device": args.device, "results": []}
    for setting in settings:
        result = in_subprocess(__file__, setting)
        summary["results"].append(result)
        print(f"{setting}: eval {result['eval_images_per_second']:.0f} img/s, featcal {result['featcal_seconds']:.1f} s, "
              + ", ".join(f"{m} {result[m]['seconds_at_target']:.1f} s" for m in
                          ("surgery", "probsurgery", "adamerging", "wudi")), flush=True)
        if args.json:
            write_json(args.json, summary)


if __name__ == "__main__":
    main()
