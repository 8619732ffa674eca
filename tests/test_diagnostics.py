"""The feature diagnostics (Fig. 1 drift, Fig. 2a cosine) end to end on the toy world."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("diagnostics_script", REPO / "scripts" / "diagnostics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_features_diagnostic_writes_drift_and_cosine(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    monkeypatch.chdir(tmp_path)  # FusionBench caches zero-shot heads under ./outputs
    out = tmp_path / "diag"
    load_script().main(["features", "--world", "toy", "-n", "8", "--surgery-steps", "3", "--out", str(out)])
    drift = json.loads((out / "drift.json").read_text())
    cosine = json.loads((out / "cosine.json").read_text())
    assert drift["command"].startswith("python scripts/diagnostics.py features --world toy")
    assert drift["machine"] and drift["date"]
    tasks = list(drift["drift"])
    for task, curves in drift["drift"].items():
        assert len(curves["upstream_l2"]) == len(curves["after_l2"]) == 3  # the toy CLIP has 3 blocks
        assert curves["after_l2"][-1] < curves["upstream_l2"][-1], task
    assert set(cosine["cosine"]) == {"Task Arithmetic", "+ Surgery", "+ FeatCal"}
    for name, per_task in cosine["cosine"].items():
        assert set(per_task) == {*tasks, "average"}
        assert all(-1.0 <= v <= 1.0 for v in per_task.values())
    assert cosine["cosine"]["+ FeatCal"]["average"] > cosine["cosine"]["Task Arithmetic"]["average"]
    assert (out / "drift.png").stat().st_size > 0 and (out / "cosine.png").stat().st_size > 0


def test_bad_arguments_fail_before_any_work(capsys):
    with pytest.raises(SystemExit):
        load_script().main(["features", "-n", "0"])
    assert "-n must be >= 1" in capsys.readouterr().err
