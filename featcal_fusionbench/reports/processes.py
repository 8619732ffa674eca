"""A command run as a child forked from this process, which imported the command's modules once.

A started ``fusion_bench`` spends 8-13 s of 2 cores importing torch, Lightning, transformers and FusionBench before it
reads its first argument (FusionBench's CLI alone: 11.5 s, 2026-11-29): the quick CLIP world's leaderboard, 69 cells,
took 36.6 minutes with each cell started and 20.7 with each forked. A forked child runs the same entry point with the
same arguments, folder, environment and output: only its imports happened earlier. Its peak RSS counts the modules
it shares with this process, as a started one counts its own imports. Forking needs one thread here (a fork copies
only the forking one, whose locks another thread may hold) and no CUDA context (a forked child cannot use it):
``can_fork`` says whether this process qualifies, and callers start the command instead where it does not.
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional, Sequence, Tuple

#: what nearly every ``fusion_bench`` run imports once it has its configuration, beyond the CLI's own modules
PRELOAD = ("fusion_bench.scripts.cli", "fusion_bench.programs.fabric_fusion_program",
           "featcal_fusionbench.integration.algorithm", "featcal_fusionbench.baselines.algorithm", "datasets",
           "fusion_bench.taskpool.clip_vision.taskpool")


def can_fork() -> bool:
    if threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())


def fusion_bench_entry() -> Callable[[], Optional[int]]:
    """FusionBench's console script's function (``fusion_bench = fusion_bench.scripts.cli:_hydra_main``, in its
    installed ``entry_points.txt``), with ``PRELOAD`` imported."""
    for module in PRELOAD:
        importlib.import_module(module)
    return importlib.import_module("fusion_bench.scripts.cli")._hydra_main


def run_forked(entry: Callable[[], Optional[int]], argv: Sequence[str], cwd, stdout, stderr,
               timeout: Optional[float] = None) -> Tuple[Optional[int], resource.struct_rusage]:
    """Run ``entry()`` in a forked child as the process ``argv`` (``sys.argv``), in folder ``cwd``, its output
    appended to the files ``stdout`` and ``stderr`` (the same file for both: interleaved as written); returns its exit
    status (None once ``timeout`` seconds passed: its process group is killed) and its resource usage."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(entry, argv, cwd, stdout, stderr)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage
        if time.monotonic() >= deadline:
            os.killpg(pid, signal.SIGKILL)
            return None, os.wait4(pid, 0)[2]
        time.sleep(0.05)


def _child(entry, argv, cwd, stdout, stderr) -> None:
    """Become the command's process. Never returns into the caller's code (its ``finally`` blocks and the exit
    handlers it registered, such as a temporary folder's removal, are the caller's, not the command's)."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, so that a timeout kills whatever the command started
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, stdout), (2, stderr)):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        # the caller's stream objects may not write to its descriptors (pytest's capture): new ones on 1 and 2
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [str(a) for a in argv]
        result = entry()
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
