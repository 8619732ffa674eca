"""`fusion_bench` runs in their own folders, cached by their command line, for the result and diagnostic scripts.

A run is skipped when its folder holds the report(s) of the very same command (``command.txt`` is written only
after the run succeeded), made on the same build of the offline world it reads (``world.txt``, the fingerprint of its
``world.json``: a rebuilt world keeps its paths, so the command alone cannot tell), so an interrupted invocation
resumes and a changed command or a rebuilt world runs again. A run made before fingerprints were recorded counts
only if it finished after the current build was written.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
REPORT = "program_report.json"
WORLD_FILE = "world.txt"
COUNTS = {"ran": 0, "resumed": 0}


def fusion_bench_executable() -> str:
    beside = Path(sys.executable).with_name("fusion_bench")
    return str(beside) if beside.exists() else "fusion_bench"


def write_json_atomic(path: Path, data) -> None:
    """Write JSON through a temporary file and a rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _report_paths(run_dir: Path, jobs: int) -> List[Path]:
    if jobs == 0:
        return [run_dir / REPORT]
    return [run_dir / f"job_{i}" / REPORT for i in range(jobs)]


def made_on(run_dir: Path, world: Optional[Path]) -> bool:
    """Whether the finished run in ``run_dir`` was made on the build of the world now at ``world`` (None: no world)."""
    if world is None:
        return True
    from .worlds.registry import build_fingerprint

    recorded = run_dir / WORLD_FILE
    if recorded.is_file():
        return recorded.read_text().strip() == (build_fingerprint(world) or "")
    built = world / "world.json"
    return built.is_file() and (run_dir / "command.txt").stat().st_mtime > built.stat().st_mtime


def execute_fusion_bench(args: Sequence[str], run_dir: Path, log_path: Path, env: Dict[str, str]) -> int:
    """Run ``fusion_bench *args`` in ``run_dir`` (FusionBench caches zero-shot heads under ``cwd/outputs/cache``) with
    ``env``, its output to ``log_path``; return its exit status. Every run of the experiments starts here."""
    with open(log_path, "w") as log:
        return subprocess.run([fusion_bench_executable(), *args], cwd=run_dir, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode


def run_fusion_bench(run_dir: Path, args: Sequence[str], jobs: int = 0, offline: bool = True,
                     world: Optional[Path] = None):
    """Run ``fusion_bench *args`` in ``run_dir`` and return its program report. With ``jobs`` > 0 it is a Hydra
    multirun (``-m``) of that many jobs, each logging to ``run_dir/job_<n>``; the reports come back in job order.
    ``world``: the root of the offline world the command reads, whose build a kept run must match."""
    args = list(args)
    if jobs:
        args = ["-m", *args, "path.log_dir=./job_${hydra:job.num}", "hydra.sweep.dir=./multirun"]
    else:
        args = [*args, "path.log_dir=."]
    text = shlex.join(args)
    reports, command_path = _report_paths(run_dir, jobs), run_dir / "command.txt"
    if (command_path.is_file() and command_path.read_text() == text and all(p.is_file() for p in reports)
            and made_on(run_dir, world)):
        COUNTS["resumed"] += 1
    else:
        COUNTS["ran"] += 1
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in [command_path, run_dir / WORLD_FILE, *reports]:
            path.unlink(missing_ok=True)
        # FusionBench's joblib cache of zero-shot heads is keyed by model path, not weights: never reuse it
        shutil.rmtree(run_dir / "outputs" / "cache", ignore_errors=True)
        env = {**os.environ, **(OFFLINE_ENV if offline else {})}
        started = time.perf_counter()
        returncode = execute_fusion_bench(args, run_dir, run_dir / "run.log", env)
        missing = [str(p) for p in reports if not p.is_file()]
        if returncode != 0 or missing:
            raise SystemExit(f"fusion_bench failed in {run_dir} (see run.log there): {text}")
        if world is not None:
            from .worlds.registry import build_fingerprint

            (run_dir / WORLD_FILE).write_text(f"{build_fingerprint(world)}\n")
        command_path.write_text(text)
        print(f"  {run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
    loaded = [json.loads(p.read_text()) for p in reports]
    return loaded if jobs else loaded[0]
