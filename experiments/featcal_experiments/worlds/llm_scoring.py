"""Scoring of the LLM world's tasks: the final number (math), unit tests run in a guarded subprocess (code), and
programmatic checks of format constraints (instruction), plus the lm-eval ``process_results`` functions that
the world's task YAMLs point at (through the ``utils.py`` written beside them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Sequence

# ---------------------------------------------------------------------------------------------------- math

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str):
    """The last number in ``text`` ("1,200" is 1200; "7.0" is 7), or None. GSM8K-style: the answer a model ends on."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1].replace(",", "").rstrip("."))
    return int(value) if value == int(value) else value


def math_correct(completion: str, answer) -> bool:
    got = final_number(completion)
    return got is not None and got == final_number(str(answer))


# ---------------------------------------------------------------------------------------------------- code

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Installed in the child before the program runs. An audit hook cannot be removed by the code it watches (PEP 578):
# writes and file-system changes outside the program's own temporary folder, new processes, native code and
# sockets raise instead of happening. The folder itself is deleted afterwards.
_GUARD = r'''
import os as _os, sys as _sys
def _install(root):
    root = _os.path.realpath(root)
    writing = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_APPEND | _os.O_TRUNC
    path_events = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copymode",
                   "shutil.copystat", "shutil.move", "shutil.chown", "os.chflags", "os.lchflags", "os.mkfifo",
                   "os.mknod"}
    denied = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
              "pty.", "ctypes.", "socket.", "os.kill", "os.killpg", "signal.")
    def inside(path):
        if isinstance(path, int):
            return True
        path = _os.fsdecode(path)
        full = _os.path.realpath(path)
        return full == root or full.startswith(root + _os.sep)
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if ((mode and any(c in mode for c in "wax+")) or (flags or 0) & writing) and not inside(path):
                raise PermissionError(f"writing outside the sandbox: {path}")
        elif event in path_events:
            for arg in args:
                if isinstance(arg, (str, bytes, _os.PathLike)) and not inside(arg):
                    raise PermissionError(f"{event} outside the sandbox: {arg}")
        elif event.startswith(denied):
            raise PermissionError(f"{event} is not allowed")
    _sys.addaudithook(hook)
_install(_os.getcwd())
del _install
'''


def extract_code(completion: str) -> str:
    """The first fenced block (an unclosed fence runs to the end), else the whole completion."""
    match = _FENCE.search(completion)
    return match.group(1) if match else completion


def _limits():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def run_tests(program: str, tests: str, timeout: float = 5.0) -> bool:
    """True when ``program`` followed by ``tests`` exits cleanly within ``timeout`` seconds, run by a separate
    isolated Python (``-I``: no user site, no environment) in a fresh temporary folder that is removed afterwards,
    with the audit-hook guard, 2 GiB of memory and 1 MiB files at most."""
    with tempfile.TemporaryDirectory(prefix="llm-world-code-") as folder:
        script = os.path.join(folder, "program.py")
        with open(script, "w") as handle:
            handle.write(f"{_GUARD}\n{program}\n\n{tests}\n")
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder}
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-B", script], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout, preexec_fn=_limits,
            )
        except subprocess.TimeoutExpired:  # run() has killed the child; the guard forbids it any children
            return False
        return done.returncode == 0


def code_passes(completion: str, tests: str, timeout: float = 5.0) -> bool:
    return run_tests(extract_code(completion), tests, timeout)


# ---------------------------------------------------------------------------------------------------- instruction


def _unfenced(text: str) -> str:
    text = text.strip()
    match = re.fullmatch(r"```[a-zA-Z]*\n?(.*?)\n?```", text, re.DOTALL)
    return match.group(1) if match else text


def _first_word(text: str) -> str:
    words = re.findall(r"[A-Za-z']+", text)
    return words[0].lower() if words else ""


def constraint_holds(kind: str, value, text: str) -> bool:
    """IFEval-style strict checks on the completion as generated (stripped of surrounding white space)."""
    text = text.strip()
    words = text.split()
    has_letters = any(c.isalpha() for c in text)
    if kind == "lowercase":
        return has_letters and text == text.lower()
    if kind == "uppercase":
        return has_letters and text == text.upper()
    if kind == "max_words":
        return 0 < len(words) < value
    if kind == "min_words":
        return len(words) >= value
    if kind == "keyword":
        return re.search(rf"\b{re.escape(value)}\b", text, re.IGNORECASE) is not None
    if kind == "json":
        try:
            json.loads(_unfenced(text))
        except ValueError:
            return False
        return True
    if kind == "bullets":
        return len(re.findall(r"^\s*[*-]\s", text, re.MULTILINE)) == value
    if kind == "end_phrase":
        return text.endswith(value)
    if kind == "start_word":
        return _first_word(text) == value.lower()
    if kind == "no_commas":
        return has_letters and "," not in text
    raise ValueError(f"unknown constraint kind {kind!r}")


def follows_all(text: str, constraints: Sequence[Dict]) -> bool:
    return all(constraint_holds(c["kind"], c["value"], text) for c in constraints)


def _constraints(doc) -> List[Dict]:
    value = doc["constraints"]
    return json.loads(value) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------------- lm-eval

def math_results(doc, results) -> Dict[str, float]:
    return {"exact_match": float(math_correct(results[0], doc["answer"]))}


def code_results(doc, results) -> Dict[str, float]:
    return {"pass@1": float(code_passes(results[0], doc["tests"]))}


def instruction_results(doc, results) -> Dict[str, float]:
    return {"prompt_level_strict_acc": float(follows_all(results[0], _constraints(doc)))}


def score(task: str, completion: str, doc) -> bool:
    """One completion of one test example, right or wrong (the same rule as the lm-eval tasks)."""
    return bool({"math": math_results, "code": code_results, "instruction": instruction_results}[task](doc, [completion]).popitem()[1])
