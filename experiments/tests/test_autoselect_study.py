"""experiments/scripts/autoselect_study.py: the targets of issue 61 read off a study's runs, the table it writes, and
bad arguments refused before anything runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import autoselect_study as study  # noqa: E402


def run(n, seed, default, auto, oracle, demo=None, blocks=()):
    entry = {
        "n": n, "seed": seed,
        "default": {"average": default, "lambda_": 0.05, "rho": 2.0, "alpha": 0.3},
        "auto": {c: {"average": v, "cost_multiple": 3.0, "vs_fixed": 2.5, "choice": None, "blocks": list(blocks)}
                 for c, v in auto.items()},
        "oracle": {"best": {"average": oracle, "lambda_": 1e-4, "rho": 2.5, "alpha": 0.6},
                   "best_at_paper_alpha": {"average": oracle - 0.2, "lambda_": 1e-5, "rho": 2.0, "alpha": 0.3}},
    }
    if demo is not None:
        entry["demo"] = {"average": demo}
    return entry


def test_summary_reads_both_targets_per_criterion_and_n():
    result = {"criteria": ["objective", "drift"],
              "runs": [run(8, 42, 45.0, {"objective": 53.1, "drift": 44.0}, 53.8),
                       run(8, 43, 46.0, {"objective": 52.0, "drift": 47.0}, 53.6),
                       run(256, 42, 46.0, {"objective": 46.2, "drift": 46.0}, 49.0)]}
    s = study.summary(result)
    eight = s["objective"]["8"]
    assert eight["auto_minus_paper"] == pytest.approx([8.1, 6.0]) and eight["meets_paper_target"]
    assert eight["mean_from_oracle"] == pytest.approx((0.7 + 1.6) / 2) and eight["worst_from_oracle"] == pytest.approx(1.6)
    assert not eight["meets_oracle_targets"]  # a mean of 1.15 and a worst of 1.6: both over
    assert s["drift"]["8"]["worst_below_paper"] == pytest.approx(1.0) and not s["drift"]["8"]["meets_paper_target"]
    assert not s["objective"]["256"]["meets_oracle_targets"] and s["objective"]["256"]["meets_paper_target"]
    assert s["objective"]["256"]["vs_fixed"] == [2.5]


def test_markdown_names_the_command_each_blocks_choice_and_whether_the_targets_hold():
    blocks = [{"block": 0, "chosen": {"lambda_": 1e-5, "rho": 2.0, "alpha": 0.3}, "margin_se": 3.25, "kept": False,
               "edge": False},
              {"block": 1, "chosen": {"lambda_": 1e-7, "rho": 2.0, "alpha": 0.3}, "margin_se": 0.5, "kept": True,
               "edge": True}]
    result = {"world": "clip-quick", "world_fingerprint": "abc", "command": "python x --world clip-quick",
              "machine": "2 CPU cores", "date": "2026-11-25 20:00 UTC", "seconds": 600, "upstream": 42.0,
              "runs_made": 3, "runs_resumed": 2, "criteria": ["objective"], "oracle_space": "full",
              "runs": [run(8, 42, 45.0, {"objective": 53.1}, 53.4, demo=44.1, blocks=blocks)]}
    result["summary"] = study.summary(result)
    text = study.markdown(result)
    assert "`python x --world clip-quick`" in text and "2026-11-25" in text and "(build abc)" in text
    assert "10 min for 3 `fusion_bench` runs, 2 more resumed" in text
    assert ("| 8 | 42 | 45.0 | 44.1 | 53.1 (2.5x; 3.0x) | 53.2 (lambda 1e-05, rho 2) "
            "| 53.4 (lambda 0.0001, rho 2.5, alpha 0.6) |") in text
    assert "lambda, rho, alpha = 0.05, 2, 0.3" in text
    assert "`objective`, n = 8: auto - paper +8.1 at worst (meets the first target)" in text
    assert "oracle - auto 0.30 on average, 0.30 at worst (meets the second)" in text
    assert "0: {'lambda_': 1e-05, 'rho': 2.0, 'alpha': 0.3} (3.2 se)" in text and "(0.5 se) kept edge" in text


@pytest.mark.parametrize("argv, message", [
    (["--world", "clip-quick", "--n", "2"], "4 folds of each task's examples at n = 2; give at least that many"),
    (["--world", "clip-quick", "--n", "6,128", "--folds", "7"], "7 folds of each task's examples at n = 6"),
    (["--world", "clip-quick", "--folds", "1"], "--folds: invalid method.auto_select: folds must be auto or"),
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


def test_the_lambda_oracle_sweeps_lambda_alone_at_the_papers_rho_and_alpha_and_resumes_its_points():
    class FakeLab:
        calls = []

        def score(self, n, seed, lambda_, rho, alpha):
            self.calls.append((lambda_, rho, alpha))
            return {"average": 50.0 - abs(lambda_ - 1e-4) * 100, "scores": {}}

    default = {"average": 50.0 - abs(0.05 - 1e-4) * 100, "lambda_": 0.05, "rho": 2.0, "alpha": 0.3}
    cached = {"points": [{"lambda_": 1e-7, "rho": 2.0, "alpha": 0.3, "average": 49.99, "tasks": {}, "seconds": 1.0}]}
    lab = FakeLab()
    out = study.oracle(lab, 256, 42, default, "lambda", cached, lambda: None)
    assert lab.calls == [(0.05, 2.0, 0.3)] + [(10.0**k, 2.0, 0.3) for k in range(-6, -1)], "1e-7 was cached"
    assert out["best"]["lambda_"] == pytest.approx(1e-4) and out["best_at_paper_alpha"] == out["best"]
    assert {p["alpha"] for p in out["grid"]} == {0.3} and {p["rho"] for p in out["grid"]} == {2.0}


def test_a_block_whose_lambda_is_the_least_shrinkage_shows_the_held_out_best():
    blocks = [{"block": 0, "chosen": "lambda_=1e-05,rho=2,alpha=0.3", "margin_se": -0.5, "kept": None,
               "edge": None, "held_out_best_lambda": 1e-4}]
    result = {"world": "t5", "world_fingerprint": "abc", "command": "python x", "machine": "m", "date": "d",
              "seconds": 60, "upstream": 24.5, "runs_made": 1, "runs_resumed": 0, "criteria": ["objective"],
              "oracle_space": "lambda", "runs": [run(256, 42, 41.9, {"objective": 42.0}, 42.1, blocks=blocks)]}
    result["summary"] = study.summary(result)
    assert "0: lambda_=1e-05,rho=2,alpha=0.3 (-0.5 se) (held-out best lambda 0.0001)" in study.markdown(result)
