import hashlib
import json

import pytest

from featcal_fusionbench import reporting
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
    assert capsys.readouterr().out.split() == ["--config-dir", str(final / "config"), "modelpool=P/fake", "taskpool=T/fake"]


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
