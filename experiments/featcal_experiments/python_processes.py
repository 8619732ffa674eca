"""The Python processes the benchmarks and the GPU check start for each of their steps (a loading mode, a method, the
CUDA tests): a fresh interpreter each, so that a step's peak RSS and device memory are its own.

``FEATCAL_FORK_SCRIPTS=1`` (the test suites set it) forks each such process from the caller's instead
(featcal_fusionbench/reports/processes.py): a fresh one spends 8-13 s importing torch, transformers and Lightning on 2
cores before it reads its arguments, which the caller has imported already (the GPU check's CPU dry run: 81 s
started, 30 s forked). The step runs the same code with the same arguments, folder and output; only its imports came
earlier, and its peak RSS counts the pages it shares with the caller, so the benchmarks' figures are made without it.
Where this process cannot fork (threads, CUDA), the step is started.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from featcal_fusionbench.reports.processes import can_fork, run_forked

FORK = "FEATCAL_FORK_SCRIPTS"


def forking() -> bool:
    return os.environ.get(FORK, "0") not in ("", "0") and can_fork()


def run_python(argv: Sequence[str], cwd: Optional[os.PathLike] = None, timeout: Optional[float] = None,
               merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """``python *argv`` (a script's path and its arguments, or ``-m module ...``) in ``cwd``, its output captured as
    text (stderr into stdout with ``merge_stderr``); raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    argv = [str(a) for a in argv]
    if argv[0].startswith("-") and argv[0] != "-m":
        raise ValueError(f"run_python: a script's path or -m module, not {argv[0]!r}")
    command = [sys.executable, *argv]
    if not forking():
        return subprocess.run(command, cwd=cwd, text=True, timeout=timeout, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    with tempfile.TemporaryDirectory(prefix="featcal-step-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        returncode, _ = run_forked(lambda: _as_python(argv), argv, cwd, out, out if merge_stderr else err, timeout)
        stdout = out.read_text(errors="replace")
        stderr = None if merge_stderr else err.read_text(errors="replace") if err.exists() else ""
    if returncode is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def _as_python(argv) -> int:
    if argv[0] == "-m":  # as `python -m`: the working folder first on the path
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # as `python script`: the script's folder first on the path
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0
