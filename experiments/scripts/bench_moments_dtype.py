"""What float64 statistics cost against float32 at real Llama block shapes: the seconds of one batch's moment update
and the bytes of a task's moments and of a block's sums, per input group, through the package's own
``LinearInputMoments`` (the accumulation that ``method.accumulation_dtype`` selects; solves are float64 either way).

    python experiments/scripts/bench_moments_dtype.py --shapes llama-3.2-3b,llama-3.1-8b --tokens 1024 \
        --json experiments/results/benchmarks/moments_dtype_cpu.json

A block's groups (``engine.step``): q/k/v share their input, o_proj, gate/up share theirs, down_proj. A group whose
outputs are narrower than its input (down_proj) keeps the projected expert side (m x d), the others the d x d cross
moment. Random inputs: the cost does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from typing import Dict, Optional

import torch

from featcal_fusionbench.core.moments import LinearInputMoments

# hidden, intermediate, query heads x head_dim, key/value heads x head_dim (the models' config.json)
SHAPES = {
    "llama-3.2-1b": (2048, 8192, 2048, 512),
    "llama-3.2-3b": (3072, 8192, 3072, 1024),
    "llama-3.1-8b": (4096, 14336, 4096, 1024),
}


def groups(shape: str) -> Dict[str, tuple]:
    """group -> (input width, {module: output width})."""
    hidden, inter, q, kv = SHAPES[shape]
    return {
        "q/k/v": (hidden, {"q": q, "k": kv, "v": kv}),
        "o_proj": (q, {"o": hidden}),
        "gate/up": (hidden, {"gate": inter, "up": inter}),
        "down_proj": (inter, {"down": hidden}),
    }


def measure(dim: int, outs: Dict[str, int], dtype: torch.dtype, tokens: int, repeats: int) -> dict:
    projected = outs if sum(outs.values()) < dim else None
    moments = LinearInputMoments(dim, dtype, torch.device("cpu"), out_dims=projected)
    g = torch.Generator().manual_seed(0)
    x_cal, x_exp = (torch.randn(tokens, dim, generator=g) for _ in range(2))
    y_exp: Optional[dict] = {n: torch.randn(tokens, m, generator=g) for n, m in outs.items()} if projected else None
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        moments.update(x_cal, None if projected else x_exp, None, y_exp)
        seconds.append(time.perf_counter() - started)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the block's sums for this group: its Gram, mean, each module's target (m x d) and bias target (m)
    sums = (dim * dim + dim + sum(m * dim + m for m in outs.values())) * itemsize
    return {"form": "projected" if projected else "cross", "update_seconds": statistics.median(seconds),
            "task_moments_bytes": moments.nbytes(), "block_sums_bytes": sums}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3.2-3b,llama-3.1-8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per batch (4 sequences of 256: 1024)")
    parser.add_argument("--repeats", type=int, default=3, help="updates timed per setting (the median is reported)")
    parser.add_argument("--json", help="write the results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    results = {}
    for shape in shapes:
        for group, (dim, outs) in groups(shape).items():
            for dtype in (torch.float32, torch.float64):
                key = f"{shape} {group} {str(dtype).removeprefix('torch.')}"
                results[key] = {"input_width": dim, **measure(dim, outs, dtype, args.tokens, args.repeats)}
                r = results[key]
                print(f"{key:34s} d={dim:5d} {r['form']:9s} update {r['update_seconds']:7.3f} s  "
                      f"task moments {r['task_moments_bytes'] / 2**20:7.0f} MiB  block sums {r['block_sums_bytes'] / 2**20:7.0f} MiB",
                      flush=True)
    summary = {}
    for shape in shapes:
        row = {}
        for dtype in ("float32", "float64"):
            entries = [results[f"{shape} {g} {dtype}"] for g in groups(shape)]
            # while a task is collected, its moments of every group and the block's sums of every group coexist
            row[dtype] = {
                "update_seconds_per_batch": sum(e["update_seconds"] for e in entries),
                "statistics_bytes": sum(e["task_moments_bytes"] + e["block_sums_bytes"] for e in entries),
            }
        row["time_ratio"] = row["float64"]["update_seconds_per_batch"] / row["float32"]["update_seconds_per_batch"]
        row["bytes_ratio"] = row["float64"]["statistics_bytes"] / row["float32"]["statistics_bytes"]
        summary[shape] = row
        print(f"{shape}: one batch's moments of a block {row['float32']['update_seconds_per_batch']:.2f} s (float32) -> "
              f"{row['float64']['update_seconds_per_batch']:.2f} s (float64) = {row['time_ratio']:.2f} x; a task's moments "
              f"+ the block's sums {row['float32']['statistics_bytes'] / 2**30:.2f} -> "
              f"{row['float64']['statistics_bytes'] / 2**30:.2f} GiB")
    if args.json:
        out = {"command": "python experiments/scripts/bench_moments_dtype.py " + " ".join(argv),
               "date": date.today().isoformat(), "machine": f"{cpu_name()}, {torch.get_num_threads()} torch threads, "
               f"torch {torch.__version__}",
               "tokens": args.tokens, "results": results, "summary": summary}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
