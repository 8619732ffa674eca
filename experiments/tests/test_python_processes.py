"""featcal_experiments/python_processes.py: a step forked (FEATCAL_FORK_SCRIPTS=1) runs as the started one does.

The driver runs in a process of its own (``commands.run``): a pytest-xdist worker has threads, where
``run_python`` does not fork."""

import json
import textwrap
from pathlib import Path

import commands  # tests/commands.py (conftest.py)

PROBE = """\
import os, sys
print("args", sys.argv[1:], os.path.basename(os.getcwd()), os.path.basename(sys.path[0]))
print("inherited", "decimal" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["message"]:
    sys.exit("stopped with a message")
sys.exit(3)
"""

DRIVER = """\
import decimal, json, os, subprocess, sys
from featcal_experiments.python_processes import forking, run_python

os.environ["FEATCAL_FORK_SCRIPTS"] = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
results = {"forking": forking()}
try:
    for name, argv, kwargs in (
        ("script", [os.path.join(here, "scripts", "probe.py"), "a", "b c"], {"cwd": os.path.join(here, "work")}),
        ("message", [os.path.join(here, "scripts", "probe.py"), "message"], {"merge_stderr": True}),
        ("module", ["-m", "probe_module", "x"], {"cwd": os.path.join(here, "scripts")}),
    ):
        done = run_python(argv, **kwargs)
        results[name] = [done.returncode, done.stdout, done.stderr]
    try:
        run_python([os.path.join(here, "scripts", "sleeper.py")], timeout=1)
    except subprocess.TimeoutExpired:
        results["timeout"] = True
finally:
    print("driver finally")  # once: a forked step never returns into its caller's code
print(json.dumps(results))
"""


def test_a_forked_step_runs_as_a_started_one(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(PROBE)
    (tmp_path / "scripts" / "probe_module.py").write_text(PROBE)
    (tmp_path / "scripts" / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    results = {}
    for fork in ("1", "0"):
        done = commands.run(str(tmp_path / "driver.py"), fork, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert lines[-2] == "driver finally" and lines.count("driver finally") == 1, done.stdout
        results[fork] = json.loads(lines[-1])
    forked, started = results["1"], results["0"]
    assert forked.pop("forking") is True and started.pop("forking") is False
    for name in ("script", "message", "module"):
        forked[name][1] = forked[name][1].replace("inherited True", "inherited False")
    assert forked == started
    assert started["script"] == [3, "args ['a', 'b c'] work scripts\ninherited False\n", "to stderr\n"]
    assert started["message"] == [1, f"args ['message'] {Path.cwd().name} scripts\ninherited False\n"
                                      "to stderr\nstopped with a message\n", None]
    assert started["module"][0] == 3 and started["module"][1].startswith("args ['x'] scripts scripts\n")
    assert started["timeout"] is True
