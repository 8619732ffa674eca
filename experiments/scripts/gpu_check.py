"""The checks that need a GPU, as one command (issue 62): `bash scripts/gpu_check.sh` runs this on a CUDA machine.

  python experiments/scripts/gpu_check.py --out experiments/results/gpu_check             # on CUDA
  python experiments/scripts/gpu_check.py --device cpu --out /tmp/gpu_check_dry           # the dry run: tiny shapes

Steps, each a process of its own with a time limit, its exit status, seconds and figures recorded:
  1. tests/test_cuda.py: streams on the device with pinned-host and disk spill, the automatic device budget, bf16
     models with float32 / float64 statistics, out of core with the device as compute and the host as store, two
     devices where there are two (skipped where there is no CUDA: the dry run records them as skipped);
  2. FeatCal's calibration stage at the CLIP ViT-B/32 TA8 shape, n = 256 per task (the paper's App. K setting: 53 s
     and 22.8 GiB host on an A800), experiments/scripts/bench_calibration.py;
  3. the Llama-3.2-3B shape out of core at 2 decoder layers, 3 tasks of 8 x 256 tokens,
     experiments/scripts/bench_llm_memory.py;
  4. with --llama70b only: the Llama-3.1-70B shape out of core at 1 decoder layer (bf16 checkpoints, float32
     statistics; 22 GiB of checkpoints and 5.5 GiB of output on disk), the device computing and the host storing:
     issue 62's 70B run, which this project's CPU machines cannot make (no bf16 matrix units: a bf16 block's
     forwards take hours there, and in float32 it needs 24 GiB of a 23.5 GiB host). Not in the default run: with the
     checkpoints' writing it takes several of the 15 minutes a lent machine gives.
Writes OUT/gpu_check.json and OUT/gpu_check.md (the machine, every step, its figures), and each bench's JSON beside
them. Exits 1 if a step failed, else 0. The dry run (--device cpu) runs the same steps at tiny shapes: it is in the
test suite so that the command cannot rot while no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from featcal_experiments.python_processes import run_python

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent

SHAPES = {
    # (bench_calibration arguments, bench_llm_memory arguments)
    "cuda": (["--arch", "clip-vit-base-patch32", "--tasks", "8", "--n", "256"],
             ["--arch", "llama-3.2-3b-shape", "--layers", "2", "--tasks", "3", "--n", "8", "--seq-len", "256"]),
    "cpu": (["--arch", "tiny", "--tasks", "2", "--n", "8"],
            ["--arch", "tiny", "--layers", "2", "--tasks", "2", "--n", "4", "--seq-len", "16"]),
}
LIMITS = {"tests": 240, "clip": 240, "llm": 300, "llm70b": 480}  # seconds per step: 13 min at most without --llama70b
#: --llama70b: issue 62's run. The CPU dry run takes the tiny shape with the same options, so that a flag the GPU run
#: would trip on trips here first, not on the device's scarce minutes.
LLAMA70B_OPTIONS = ["--dtype", "bfloat16", "--storage-dtype", "bfloat16", "--accumulation-dtype", "float32", "--profile"]
LLAMA70B = {
    "cuda": ["--arch", "llama-3.1-70b-shape", "--layers", "1", "--tasks", "3", "--n", "8", "--seq-len", "256",
             *LLAMA70B_OPTIONS],
    "cpu": ["--arch", "tiny", "--layers", "1", "--tasks", "2", "--n", "4", "--seq-len", "16", *LLAMA70B_OPTIONS],
}


def run_step(name: str, command, out: Path, limit: int) -> dict:
    started = time.perf_counter()
    log = out / f"{name}.log"
    try:
        done = run_python(command, cwd=REPO, timeout=limit, merge_stderr=True)
        returncode, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as error:
        returncode, output = "timeout", (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
    log.write_text(output)
    return {"name": name, "command": " ".join(["python", *map(str, command)]).replace(f"{REPO}/", ""), "returncode": returncode,
            "seconds": time.perf_counter() - started, "log": log.name, "tail": output[-1500:]}


def test_counts(output: str) -> dict:
    """pytest's summary line as numbers: passed, failed, skipped, errors."""
    counts = {}
    for number, what in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", output):
        counts["errors" if what.startswith("error") else what] = int(number)
    return counts


def machine(device: str) -> dict:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "device": device}
    if device == "cuda":
        info.update(cuda=torch.version.cuda, gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return info


def figures(step: dict, path: Path) -> dict:
    """The bench's own figures: calibration seconds, its ratio to the forward floor, peak host and device memory."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    result = data["results"][0]
    keep = ("seconds", "forward_floor_seconds", "ratio_to_floor", "peak_rss_bytes", "peak_device_bytes",
            "statistics_bytes", "model_bytes", "output_bytes")
    return {k: result[k] for k in keep if k in result}


def markdown(summary: dict) -> str:
    m = summary["machine"]
    where = ", ".join(m.get("gpus") or []) or "no GPU (the CPU dry run at tiny shapes)"
    lines = [f"# GPU check ({summary['date']})", "", f"Command: `{summary['command']}`. Machine: {where}; torch "
             f"{m['torch']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "") + f"; {m['cpu_count']} CPU cores. "
             f"In all {summary['seconds']:.0f} s.", "", "| step | exit | seconds | figures |", "|---|---|---:|---|"]
    gib = 2**30
    for step in summary["steps"]:
        f = step.get("figures") or {}
        shown = []
        if "counts" in step:
            shown.append(", ".join(f"{v} {k}" for k, v in step["counts"].items()))
        if "seconds" in f:
            shown.append(f"calibration {f['seconds']:.1f} s ({f.get('ratio_to_floor', float('nan')):.2f} x the forward floor)")
        if f.get("peak_rss_bytes"):
            shown.append(f"peak host RSS {f['peak_rss_bytes'] / gib:.2f} GiB")
        if f.get("peak_device_bytes"):
            shown.append(f"peak device {f['peak_device_bytes'] / gib:.2f} GiB")
        lines.append(f"| {step['name']}: `{step['command']}` | {step['returncode']} | {step['seconds']:.0f} | "
                     f"{'; '.join(shown)} |")
    return "\n".join(lines) + "\n"


def llm_step(name: str, bench_args, device: str, out: Path, json_path: Path) -> dict:
    """One out-of-core LLM bench as a step, its checkpoints removed after it (gigabytes at the 3B shape, 28 GiB at
    the 70B one)."""
    work = out / "work"
    step = run_step(name, [str(SCRIPTS / "bench_llm_memory.py"), *bench_args, "--modes", "out_of_core",
                           "--device", device, "--workdir", str(work), "--json", str(json_path)], out, LIMITS[name])
    step["figures"] = figures(step, json_path)
    shutil.rmtree(work, ignore_errors=True)
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=sorted(SHAPES), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--llama70b", action="store_true", help="also step 4, the Llama-3.1-70B shape (see above)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was checked")
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    clip_args, llm_args = SHAPES[args.device]
    started = time.perf_counter()
    steps = []
    step = run_step("tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"], out,
                    LIMITS["tests"])
    step["counts"] = test_counts(step["tail"])
    steps.append(step)
    clip_json = out / "clip_b32_ta8.json" if args.device == "cuda" else out / "clip_tiny.json"
    step = run_step("clip", [str(SCRIPTS / "bench_calibration.py"), *clip_args, "--methods", "featcal",
                             "--device", args.device, "--json", str(clip_json)], out, LIMITS["clip"])
    step["figures"] = figures(step, clip_json)
    steps.append(step)
    llm_json = out / "llama3b_2layers_out_of_core.json" if args.device == "cuda" else out / "llm_tiny.json"
    steps.append(llm_step("llm", llm_args, args.device, out, llm_json))
    if args.llama70b:
        llm70b_json = out / ("llama70b_1layer_bf16_f32_out_of_core.json" if args.device == "cuda" else "llm70b_tiny.json")
        steps.append(llm_step("llm70b", LLAMA70B[args.device], args.device, out, llm70b_json))
    failed = [s["name"] for s in steps if s["returncode"] != 0 or s.get("counts", {}).get("failed")]
    summary = {"command": "python experiments/scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(args.device),
               "seconds": time.perf_counter() - started, "steps": steps, "failed": failed}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (out / "gpu_check.md").write_text(markdown(summary))
    print(markdown(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
