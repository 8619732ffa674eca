"""The tests' runner of console scripts (``commands.py``): a forked command does what a started one does."""

import os
import subprocess
import sys

import pytest

import commands

pytestmark = pytest.mark.slow  # starts fusion_bench from scratch once


def test_a_forked_command_prints_and_exits_as_a_started_one(tmp_path):
    args = ["--cfg", "job", "method=featcal", "method.lambda_=0.01"]
    forked = commands.run("fusion_bench", *args, cwd=tmp_path)
    assert commands._server is not None and commands._server.serves({**os.environ, **commands.OFFLINE})
    started = subprocess.run([str(commands.BIN / "fusion_bench"), *args], cwd=tmp_path,
                             env={**os.environ, **commands.OFFLINE}, capture_output=True, text=True, timeout=600)
    assert (forked.returncode, forked.stdout) == (started.returncode, started.stdout) == (0, started.stdout)
    assert "lambda_: 0.01" in forked.stdout

    failed = commands.run("fusion_bench", "method=featcal", "method.alpha=1.5", "modelpool=nothing", cwd=tmp_path)
    assert failed.returncode == 1 and "Could not find 'modelpool/nothing'" in failed.stderr


def test_a_python_script_is_forked_and_runs_as_python_would_run_it(tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    (script.parent / "sibling.py").write_text("VALUE = 'beside the script'\n")
    script.write_text("import os, sys\nimport sibling\n"
                      "print(__name__, sys.argv[1:], sibling.VALUE, os.getcwd(), os.getppid())\n"
                      "sys.exit(3)\n")
    forked = commands.run(str(script), "a", "b c", cwd=tmp_path)
    started = subprocess.run([sys.executable, str(script), "a", "b c"], cwd=tmp_path, capture_output=True, text=True)
    assert forked.returncode == started.returncode == 3, forked.stderr[-2000:]
    *shown, parent = forked.stdout.split()
    assert shown == started.stdout.split()[:-1] == ["__main__", "['a',", "'b", "c']", "beside", "the", "script",
                                                    str(tmp_path)]
    assert int(parent) == commands._server.process.pid  # forked by the server, not started by this process


def test_a_run_time_variable_is_the_commands_own_and_an_import_time_one_starts_a_process(tmp_path):
    probe = commands.run("fusion_bench", "--cfg", "job", "--resolve", "+probe=${oc.env:FEATCAL_WORLDS_DIR}",
                         cwd=tmp_path, env={**os.environ, "FEATCAL_WORLDS_DIR": str(tmp_path / "worlds")})
    assert probe.returncode == 0 and f"probe: {tmp_path / 'worlds'}" in probe.stdout, probe.stderr[-2000:]
    report = commands.run("featcal-report", "sweep", "runs", cwd=tmp_path)
    assert report.returncode != 0 and "featcal-report sweep: runs: no such folder" in report.stderr
    assert commands._server.serves({**os.environ, **commands.OFFLINE, "FEATCAL_WORLDS_DIR": "elsewhere"})
    assert not commands._server.serves({**os.environ, **commands.OFFLINE, "HF_ENDPOINT": "http://127.0.0.1:9"})


def test_variables_the_imports_set_in_the_test_process_still_fork_and_reach_the_command(tmp_path):
    # a server started where torch has not been imported yet (this process may have imported it: conftest.py)
    before_torch = {k: v for k, v in {**os.environ, **commands.OFFLINE}.items() if not k.startswith("KMP_")}
    with commands.serving(before_torch) as server:
        assert "KMP_INIT_AT_FORK" in server.set_by_imports  # set by importing torch, as every fusion_bench does
        after_torch = {**before_torch, **server.set_by_imports}
        assert server.serves(before_torch) and server.serves(after_torch)
        assert not server.serves({**after_torch, "KMP_INIT_AT_FORK": "TRUE"})
        forked = commands.run("fusion_bench", "--cfg", "job", "--resolve", "+probe=${oc.env:KMP_INIT_AT_FORK,unset}",
                              cwd=tmp_path, env=before_torch)
    # what the server's torch import set, as a started command's own import would set it before reading arguments
    assert f"probe: '{server.set_by_imports['KMP_INIT_AT_FORK']}'" in forked.stdout, forked.stderr[-2000:]
