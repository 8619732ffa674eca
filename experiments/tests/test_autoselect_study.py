"""experiments/scripts/autoselect_study.py: the targets of issue 27 read off a study's runs, the table it writes, and
bad arguments refused before anything runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import autoselect_study as study  # noqa: E402


def run(n, default, auto, oracle, demo=None):
    entry = {
        "n": n, "seed": 42,
        "default": {"average": default, "lambda_": 0.05, "rho": 2.0, "alpha": 0.3},
        "auto": {c: {"average": v, "cost_multiple": 3.0} for c, v in auto.items()},
        "oracle": {"best": {"average": oracle, "lambda_": 1e-4, "rho": 2.5, "alpha": 0.3}},
    }
    if demo is not None:
        entry["demo"] = {"average": demo}
    return entry


def test_summary_reads_both_targets_per_criterion():
    result = {"runs": [run(8, 45.0, {"objective": 53.1, "drift": 44.0}, 53.8),
                       run(256, 46.0, {"objective": 46.2, "drift": 46.0}, 49.0)]}
    s = study.summary(result)
    assert s["objective"]["auto_minus_default"] == pytest.approx([8.1, 0.2])
    assert s["objective"]["meets_default_target"] and s["objective"]["mean_from_oracle"] == pytest.approx(1.75)
    assert not s["objective"]["meets_oracle_target"]
    assert s["drift"]["worst_below_default"] == pytest.approx(1.0) and not s["drift"]["meets_default_target"]


def test_markdown_names_the_command_the_oracle_and_the_demo_column():
    result = {"world": "clip-quick", "world_fingerprint": "abc", "command": "python x --world clip-quick",
              "machine": "2 CPU cores", "date": "2026-11-25 20:00 UTC", "seconds": 600, "upstream": 42.0,
              "runs_made": 3, "runs_resumed": 2,
              "criteria": ["objective"], "oracle_keys": "lambda_rho_alpha",
              "runs": [run(8, 45.0, {"objective": 53.1}, 53.8, demo=44.1)]}
    result["summary"] = study.summary(result)
    text = study.markdown(result)
    assert "`python x --world clip-quick`" in text and "2026-11-25" in text and "(build abc)" in text
    assert "10 min for 3 `fusion_bench` runs, 2 more resumed" in text
    assert "| 8 | 42 | 45.0 | 44.1 | 53.1 (3.0x) | 53.8 (lambda 0.0001, rho 2.5, alpha 0.3) |" in text
    assert "lambda, rho, alpha = 0.05, 2, 0.3" in text and "meets the first target" in text
    assert "lambda sweep" not in text  # a lambda x rho x alpha grid is too long to list


def test_a_lambda_only_oracle_lists_its_sweep():
    entry = run(32, 81.2, {"objective": 81.2}, 81.25)
    entry["oracle"]["grid"] = [{"lambda_": 1e-6, "average": 81.25}, {"lambda_": 10.0, "average": 57.8125}]
    result = {"world": "llm", "world_fingerprint": "abc", "command": "python x --world llm", "machine": "m",
              "date": "d", "seconds": 60, "upstream": 61.5, "runs_made": 1, "runs_resumed": 0,
              "criteria": ["objective"], "oracle_keys": "lambda_", "runs": [entry]}
    result["summary"] = study.summary(result)
    assert "- lambda sweep at n = 32, seed 42 (average): 1e-06: 81.2, 10: 57.8" in study.markdown(result)


@pytest.mark.parametrize("argv, message", [
    (["--world", "clip-quick", "--n", "1"], "at least 2"),
    (["--world", "clip-quick", "--criteria", "vibes"], "unknown"),
    (["--world", "clip-quick", "--seeds", "x"], "comma-separated integers"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        study.main([*argv, "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_an_unbuilt_world_is_named_with_its_build_command(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    with pytest.raises(SystemExit):
        study.main(["--world", "t5", "--runs", str(tmp_path / "runs")])
    assert "featcal-world build t5" in capsys.readouterr().err


def test_commands_show_run_folders_relative_to_the_repository_and_the_worlds_folder_as_its_variable(monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", "/home/someone/worlds")
    args = ["method=featcal/clip_ta", f"method.merged_model_path={study.REPO}/outputs/autoselect/x/ta/merged",
            "hydra.searchpath=[file:///home/someone/worlds/llm/config]", "path.log_dir=/tmp/elsewhere"]
    assert study.shown(args) == ("fusion_bench method=featcal/clip_ta "
                                 "method.merged_model_path=outputs/autoselect/x/ta/merged "
                                 "hydra.searchpath=[file://${FEATCAL_WORLDS_DIR}/llm/config]")
