"""A process that has imported the console scripts' modules and forks a child for each command it is sent
(``commands.run``): the child is that command's process, less the 6-9 s each `fusion_bench` spends importing torch,
Lightning, transformers and FusionBench before it reads its first argument.

Protocol, one JSON line each way on stdin / stdout: first, once imported, ``{"set_by_imports"}`` (the variables
the imports set, which the children get too); then for each command a request ``{"script", "argv", "cwd", "env",
"stdout", "stderr"}`` (``script``: a console script's name, or the path of a Python script to run as ``__main__``),
a reply ``{"pid"}`` once the child runs and ``{"returncode"}`` when it has exited. The server never runs a command
itself, so no thread or device state exists when it forks; EOF on stdin ends it.
"""

import importlib
import json
import os
import runpy
import sys
import threading
from functools import partial

from featcal_fusionbench.reports.processes import PRELOAD  # imported too: what nearly every command imports

#: console script -> (module, function), as the installed scripts in the interpreter's bin folder call them
ENTRY_POINTS = {
    "fusion_bench": ("fusion_bench.scripts.cli", "_hydra_main"),
    "featcal-report": ("featcal_fusionbench.reports.cli", "main"),
}


def run_path(path: str) -> int:
    """A Python script (``python path args``): its folder first on the path, run as ``__main__``."""
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")
    return 0


def child(request: dict, entry) -> None:
    """Become the command's process: its folder, arguments and output files (over the protocol's stdin and stdout),
    then exit as the script does."""
    # a process group of its own, so that a timed-out command is killed with whatever it started; not a session of
    # its own: with autogroup scheduling a session competes with the rest of the machine as a whole
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])  # the server's, but for what differs in each test (``commands.RUN_TIME``)
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.exit(entry())  # unwinds to the interpreter's own exit: atexit handlers and stream flushes as in a process


def main() -> None:
    # a script's first path entry is its own folder: the console script's is the interpreter's bin folder
    sys.path[0] = os.path.dirname(sys.executable)
    before = dict(os.environ)
    entries = {}
    for script, (module, function) in ENTRY_POINTS.items():
        entries[script] = getattr(importlib.import_module(module), function)
    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a fork copies only the forking thread: another's locks would never open
        sys.exit(f"command_server: the imports started threads {threading.enumerate()}; run the commands unforked")
    requests, replies = sys.stdin, sys.stdout
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    replies.write(json.dumps({"set_by_imports": set_by_imports}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            script = request["script"]
            child(request, entries[script] if script in entries else partial(run_path, script))
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
