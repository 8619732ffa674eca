"""Run the product's console scripts (`fusion_bench`, `featcal-report`) and the experiments' Python scripts as the
tests' commands.

Each command is a process of its own, as a user's is, but forked from a server (``command_server.py``, one per test
process, and one for each environment a group of tests names with ``serving``) that imported the scripts' modules
once, when the command's environment is the server's: a module may read its environment when it is imported
(huggingface_hub's endpoint and cache, the offline switches, PYTHONPATH), so a command with any other environment
is started from scratch (``subprocess.run``), as is every other program. A forked command and a started
one differ only in when the imports happened.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Mapping, Optional, Sequence

from command_server import ENTRY_POINTS

BIN = Path(sys.executable).parent
#: variables read when used, never at import: a command may set them to its own values and still be forked
RUN_TIME = (
    "PYTEST_CURRENT_TEST", "FEATCAL_WORLDS_DIR",
    "HF_TOKEN",  # huggingface_hub 0.36.2 reads it at each request (utils/_auth.py, _get_token_from_environment)
    "MASTER_PORT",  # Lightning's environment reads it when Fabric launches (fabric/plugins/environments/lightning.py);
    # a test that ran Fabric in its own process leaves it set there
    "HF_XET_HIGH_PERFORMANCE",  # set by importing lm_eval (its __init__.py), read by hf_xet when it downloads
)
#: what the CLI tests add to the environment: hub access is off unless a test serves a hub of its own
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def share_the_cores() -> None:
    """Under pytest-xdist, one thread for this worker's torch and for every command it starts (``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS``, read when torch is imported; a value already set is kept): the workers share the cores, and
    two OpenMP threads on cores another worker keeps busy wait for each other at every parallel region (the LLM
    world's mini build beside a busy core: 105 s with two threads, 62 s with one)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


class _Server:
    def __init__(self, env: Mapping[str, str]):
        self.env = _import_time(env)
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("command_server.py"))],
                                        env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        bufsize=1)
        self.pending = b""  # read from the server, not yet a whole line (a file object's buffer would hide it
        # from select)
        # torch, transformers and tokenizers set variables when imported (KMP_*, TOKENIZERS_PARALLELISM, ...): a
        # started command's imports would set the same, and a test process that imported them holds them too
        self.set_by_imports = self.reply(600)["set_by_imports"]

    def reply(self, timeout: Optional[float]) -> Optional[dict]:
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the command server exited ({self.process.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def differences(self, env: Mapping[str, str]) -> list:
        """The variables that keep a command with ``env`` from being forked: those not as the server's (one its imports
        set may be absent, as in a process that has not imported them yet)."""
        own, imported = _import_time(env), self.set_by_imports

        def differs(key: str) -> bool:
            if key in imported:
                return own.get(key, imported[key]) != imported[key]
            return own.get(key) != self.env.get(key)

        return sorted(filter(differs, {*own, *self.env, *imported}))

    def serves(self, env: Mapping[str, str]) -> bool:
        return not self.differences(env)

    def run(self, script: str, argv: Sequence[str], cwd, env, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="command-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"script": script, "argv": [_program(script), *argv], "cwd": str(cwd),
                       "env": {**env, **self.set_by_imports},
                       "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self.reply(60)["pid"]
            done = self.reply(timeout)
            if done is None:
                os.killpg(pid, signal.SIGKILL)
                self.reply(60)
            output = out.read_text(errors="replace"), err.read_text(errors="replace")
        if done is None:
            raise subprocess.TimeoutExpired([script, *argv], timeout, *output)
        return subprocess.CompletedProcess([script, *argv], done["returncode"], *output)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


_server: Optional[_Server] = None  # for the tests' usual environment, this process's with the offline switches
_extra: List[_Server] = []  # for the environments of ``serving``


def _is_python_script(script: str) -> bool:
    return script.endswith(".py")


def _program(script: str) -> str:
    """``argv[0]`` of ``script``: a console script's path in the interpreter's bin folder, a Python script's own."""
    return script if _is_python_script(script) else str(BIN / script)


def _import_time(env: Mapping[str, str]) -> dict:
    return {k: v for k, v in env.items() if k not in RUN_TIME}


def _forking() -> bool:
    return os.environ.get("FEATCAL_TEST_FORK", "1") != "0"


@contextmanager
def serving(env: Mapping[str, str]) -> Iterator[Optional[_Server]]:
    """While the context lasts, fork the commands whose environment is ``env`` from a server of their own (one
    started with ``env``): for a group of tests that share an import-time environment other than the usual one, such
    as the hub-mirror tests' endpoint and ``HF_HOME``. Yields the server (None where forking is off)."""
    if not _forking():
        yield None
        return
    server = _Server(env)
    _extra.append(server)
    try:
        yield server
    finally:
        _extra.remove(server)
        server.close()


def _log_unforked(env: Mapping[str, str], servers: Sequence[_Server]) -> None:
    """With FEATCAL_TEST_FORK_LOG set, name the variables that kept a command from being forked (a file to read
    when the suite is slower than it should be)."""
    path = os.environ.get("FEATCAL_TEST_FORK_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {[s.differences(env) for s in servers]}\n")


def run(script: str, *args, cwd=None, env: Optional[Mapping[str, str]] = None, timeout: float = 600,
        offline: bool = True) -> subprocess.CompletedProcess:
    """``script`` (a console script of this interpreter, or the path of a Python script it runs) with ``args`` in
    ``cwd``, its output captured as text; the environment is ``env`` (default: this process's) with the offline
    switches where ``offline``."""
    global _server
    env = {**(os.environ if env is None else env), **(OFFLINE if offline else {})}
    cwd = os.getcwd() if cwd is None else cwd
    args = [str(a) for a in args]
    if (script in ENTRY_POINTS or _is_python_script(script)) and _forking():
        served = [s for s in _extra if s.serves(env)]
        if not served:
            if _server is None:
                _server = _Server({**os.environ, **OFFLINE})
                atexit.register(_server.close)
            served = [_server] if _server.serves(env) else []
        if served:
            return served[0].run(script, args, cwd, env, timeout)
        _log_unforked(env, [_server, *_extra])
    program = [sys.executable, script] if _is_python_script(script) else [str(BIN / script)]
    return subprocess.run([*program, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
