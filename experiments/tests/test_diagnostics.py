"""The feature diagnostics (Fig. 1 drift, Fig. 2a cosine) end to end on the toy world."""

import importlib.util
import json
from pathlib import Path

import pytest

from featcal_experiments.worlds import registry

pytestmark = pytest.mark.slow  # the diagnostics run fusion_bench

REPO = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("diagnostics_script", REPO / "experiments" / "scripts" / "diagnostics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_features_diagnostic_writes_drift_and_cosine(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    monkeypatch.chdir(tmp_path)  # FusionBench caches zero-shot heads under ./outputs
    out = tmp_path / "diag"
    load_script().main([
        "features", "--world", "toy", "-n", "8", "--surgery-steps", "3", "--out", str(out), "--runs", str(tmp_path / "runs"),
    ])
    drift = json.loads((out / "drift.json").read_text())
    cosine = json.loads((out / "cosine.json").read_text())
    assert drift["command"].startswith("python experiments/scripts/diagnostics.py features --world toy")
    assert drift["machine"] and drift["date"]
    assert drift["world_fingerprint"] == registry.world_fingerprint("toy")  # which build the numbers came from
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


def test_corruption_diagnostic_calibrates_on_corrupted_train_images(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    out = tmp_path / "diag"
    load_script().main([
        "corruption", "--world", "toy", "-n", "8", "--calibrators", "featcal", "--corruptions", "clean,fog",
        "--out", str(out), "--runs", str(tmp_path / "runs"),
    ])
    result = json.loads((out / "corruption.json").read_text())
    assert set(result["accuracy"]["featcal"]) == {"clean", "fog", "average"}
    sources = result["calibration_data"]["featcal"]
    assert set(sources["clean"].values()) == {"the pool's train split"}
    assert all("CorruptedImageDataset" in s and "'corruption': 'fog'" in s for s in sources["fog"].values())
    assert (out / "corruption.png").stat().st_size > 0


def test_sweep_diagnostic_merges_once_and_sweeps_by_multirun(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    out, runs = tmp_path / "diag", tmp_path / "runs"
    args = ["sweep", "--world", "toy", "-n", "8", "--upstreams", "ta", "--grid-lambda", "0.01,100",
            "--grid-rho", "", "--grid-alpha", "", "--out", str(out), "--runs", str(runs)]
    load_script().main(args)
    result = json.loads((out / "sweep.json").read_text())
    lam = result["featcal"]["ta"]["lambda_"]
    assert lam["values"] == [0.01, 100.0] and len(lam["accuracy"]) == 2
    # a huge ridge returns (close to) the anchor rho * merged + (1 - rho) * base, not the merged model: only
    # check that both jobs ran on the one saved merged model and differ in their lambda
    reports = [json.loads((runs / "ta_lambda_" / f"job_{i}" / "featcal_report.json").read_text()) for i in range(2)]
    assert [r["hparams"]["lambda_"] for r in reports] == [0.01, 100.0]
    assert all(r["upstream"] == f"path:{runs / 'merged_ta'}" for r in reports)
    assert (out / "sweep.png").stat().st_size > 0
    # a second invocation resumes every run from its report
    from featcal_experiments.cli_runs import COUNTS

    before = dict(COUNTS)
    load_script().main(args)
    assert COUNTS["ran"] == before["ran"] and COUNTS["resumed"] == before["resumed"] + 2


def test_figure_titles_wrap_long_commands_without_losing_text():
    from featcal_experiments.diagnostics import _wrapped

    command = "python experiments/scripts/diagnostics.py corruption --calibrators featcal,probsurgery --out docs/x --runs outputs/y"
    title = _wrapped(f"Calibration data corrupted\n{command} | 2026-11-24", 40)
    assert all(len(line) <= 40 for line in title.splitlines())
    assert title.splitlines()[0] == "Calibration data corrupted"
    assert " ".join(title.splitlines()[1:]) == f"{command} | 2026-11-24"
