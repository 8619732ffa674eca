import hashlib
import json

import pytest

from featcal_fusionbench.integration import reporting
from featcal_experiments.worlds import cli, registry


def test_world_commands_build_atomically_and_locate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path))
    calls = []

    def fake_build(root):
        calls.append(root)
        (root / "config").mkdir(parents=True)
        (root / "config" / "pool.yaml").write_text(f"path: {root.resolve()}/x\n")
        (root / "world.json").write_text("{}")

    monkeypatch.setitem(registry.WORLDS, "fake", registry.World("fake", "test", fake_build, "P/fake", "T/fake"))
    assert cli.main(["path", "fake"]) == 1
    assert registry.world_fingerprint("fake") is None  # not built
    assert "featcal-world build fake" in capsys.readouterr().err
    assert cli.main(["build", "fake"]) == 0
    final = tmp_path / "fake"
    assert (final / "world.json").is_file()
    assert (final / "config" / "pool.yaml").read_text() == f"path: {final}/x\n"  # paths point at the final place
    assert not list(tmp_path.glob(".fake.partial-*"))
    assert registry.world_fingerprint("fake") == hashlib.sha1(b"{}").hexdigest()[:12]
    cli.main(["build", "fake"])
    assert len(calls) == 1  # already built: skipped
    capsys.readouterr()
    assert cli.main(["args", "fake"]) == 0
    # a searchpath override, not --config-dir: it works anywhere on the command line
    assert capsys.readouterr().out.split() == [f"hydra.searchpath=[file://{final / 'config'}]", "modelpool=P/fake",
                                               "taskpool=T/fake"]


def test_a_build_killed_with_sigterm_leaves_nothing_behind(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import time\n"
        "from featcal_experiments.worlds import registry\n"
        "def slow(root):\n"
        "    (root / 'half').mkdir(parents=True)\n"
        "    time.sleep(120)\n"
        "registry.WORLDS['slow'] = registry.World('slow', 'test', slow, 'P/slow', 'T/slow')\n"
        "registry.build_world('slow')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, registry.ENV_DIR: str(tmp_path)})
    deadline = time.time() + 120
    while not list(tmp_path.glob(".slow.partial-*/half")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob(".slow.partial-*/half")), "the build never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path))

    def broken(root):
        (root / "half").mkdir(parents=True)
        raise RuntimeError("boom")

    monkeypatch.setitem(registry.WORLDS, "broken", registry.World("broken", "test", broken, "P", "T"))
    with pytest.raises(RuntimeError, match="boom"):
        registry.build_world("broken")
    assert list(tmp_path.iterdir()) == []


def test_comparison_table_lists_tasks_average_and_gain(tmp_path, capsys):
    report = {
        "upstream": {"model_info": {}, "a": {"accuracy": 0.5}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.6}},
        "featcal": {"model_info": {}, "a": {"accuracy": 0.75}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.725}},
        "featcal_calibration": {"seconds": 1.5},
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert reporting.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| a | 50.0 | 75.0 | +25.0 |" in out
    assert "| average | 60.0 | 72.5 | +12.5 |" in out
    assert "1.50 s" in out
    with pytest.raises(KeyError, match="return_upstream"):
        reporting.comparison_table({"featcal": {}})


def test_two_reports_print_ta_featcal_and_surgery_as_rows(tmp_path, capsys):
    featcal = {
        "upstream": {"a": {"accuracy": 0.5}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.6}},
        "featcal": {"a": {"accuracy": 0.75}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.725}},
        "featcal_calibration": {"seconds": 1.5},
    }
    surgery = {"model_info": {}, "a": {"accuracy": 0.8}, "b": {"accuracy": 0.9}, "average": {"accuracy": 0.85}}
    (tmp_path / "f").mkdir()
    (tmp_path / "s").mkdir()
    (tmp_path / "f" / "program_report.json").write_text(json.dumps(featcal))
    (tmp_path / "s" / "program_report.json").write_text(json.dumps(surgery))
    (tmp_path / "s" / "surgery_report.json").write_text(json.dumps({"seconds": 12.25}))
    assert reporting.main([str(tmp_path / "f" / "program_report.json"), str(tmp_path / "s" / "program_report.json")]) == 0
    out = capsys.readouterr().out
    assert "| model | a | b | average |" in out
    assert "| TA | 50.0 | 70.0 | 60.0 |" in out
    assert "| TA + FeatCal | 75.0 | 70.0 | 72.5 |" in out
    assert "| TA + Surgery | 80.0 | 90.0 | 85.0 |" in out
    assert "FeatCal 1.5 s, Surgery 12.2 s" in out
    auto = {"model_info": {}, "a": {"accuracy": 0.85}, "b": {"accuracy": 0.75}, "average": {"accuracy": 0.8},
            "featcal_calibration": {"seconds": 4.0}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "program_report.json").write_text(json.dumps(auto))
    paths = [str(tmp_path / d / "program_report.json") for d in ("f", "s", "a")]
    assert reporting.main(paths) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| TA")]
    assert rows == ["| TA | 50.0 | 70.0 | 60.0 |", "| TA + FeatCal | 75.0 | 70.0 | 72.5 |",
                    "| TA + FeatCal, label-free (auto_select) | 85.0 | 75.0 | 80.0 |", "| TA + Surgery | 80.0 | 90.0 | 85.0 |"]
