"""``featcal-report compare`` on runs laid out as FusionBench writes them: the quick start's table."""

import json

import pytest

from featcal_fusionbench.reports.cli import main
from featcal_fusionbench.reports.runs import section_scores

TA = "method:fusion_bench.method.TaskArithmeticAlgorithm"


def run_folder(folder, program_report, method=None, method_report=None):
    folder.mkdir()
    (folder / "program_report.json").write_text(json.dumps(program_report))
    if method is not None:
        (folder / f"{method}_report.json").write_text(json.dumps(method_report))
    return folder


def test_compare_prints_the_upstream_featcal_auto_select_and_surgery_as_rows(tmp_path, capsys):
    featcal = run_folder(tmp_path / "f", {
        "upstream": {"model_info": {}, "a": {"accuracy": 0.5}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.6}},
        "featcal": {"model_info": {}, "a": {"accuracy": 0.75}, "b": {"accuracy": 0.7}, "average": {"accuracy": 0.725}},
        "featcal_calibration": {"seconds": 1.5},
    }, "featcal", {"upstream": TA, "seconds": 1.5, "blocks": []})
    auto = run_folder(tmp_path / "a", {"model_info": {}, "a": {"accuracy": 0.85}, "b": {"accuracy": 0.75},
                                       "average": {"accuracy": 0.8}},
                      "featcal", {"upstream": TA, "seconds": 4.0, "blocks": [{"block": 0, "hparams": {"lambda_": 1e-6}}]})
    surgery = run_folder(tmp_path / "s", {"model_info": {}, "a": {"accuracy": 0.8}, "b": {"accuracy": 0.9},
                                          "average": {"accuracy": 0.85}}, "surgery", {"upstream": TA, "seconds": 12.25})
    assert main(["compare", str(featcal), str(auto / "program_report.json"), str(surgery)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| model | a | b | average |"
    assert out[2:6] == ["| TaskArithmetic | 50.0 | 70.0 | 60.0 |", "| TaskArithmetic + FeatCal | 75.0 | 70.0 | 72.5 |",
                        "| TaskArithmetic + FeatCal, label-free (auto_select) | 85.0 | 75.0 | 80.0 |",
                        "| TaskArithmetic + Surgery | 80.0 | 90.0 | 85.0 |"]
    assert "calibration time: FeatCal 1.5 s, FeatCal, label-free (auto_select) 4.0 s, Surgery 12.2 s" in out


def test_a_run_that_did_not_finish_is_named(tmp_path, capsys):
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "overrides.yaml").write_text("- method=featcal\n")
    assert main(["compare", str(tmp_path / "stopped")]) == 1
    assert "no program_report.json" in capsys.readouterr().err


@pytest.mark.parametrize("section, expected", [
    ({"a": {"accuracy": 0.5}, "average": {"accuracy": 0.5}, "model_info": {"x": 1}}, {"a": 0.5, "average": 0.5}),
    ({"t": {"score": 0.25, "exact_match,none": 0.25, "sample_len": 2.0}}, {"t": 0.25, "average": 0.25}),  # lm-eval pool
    ({"a": {"accuracy": 1.0}, "featcal_calibration": {"seconds": 3.0}}, {"a": 1.0, "average": 1.0}),  # no task
])
def test_scores_are_read_as_the_task_pools_write_them(section, expected):
    assert section_scores(section) == expected


def test_runs_are_found_in_a_natural_order_beside_other_folders(tmp_path):
    from featcal_fusionbench.reports.runs import find_runs

    for name in ("10", "2", "extra", "0"):
        run_folder(tmp_path / name, {"a": {"accuracy": 0.5}, "average": {"accuracy": 0.5}})
    (tmp_path / "not_a_run").mkdir()
    assert [p.name for p in find_runs(tmp_path)] == ["0", "2", "10", "extra"]


def test_a_sweep_whose_runs_all_failed_is_listed_without_a_picture(tmp_path, capsys):
    for job in ("0", "1"):
        (tmp_path / job).mkdir()
        (tmp_path / job / "overrides.yaml").write_text(f"- method=featcal\n- method.lambda_={job}\n")
    assert main(["sweep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 runs scored, 2 failed" in out and "no run has scores to draw" in out
    assert (tmp_path / "sweep.csv").is_file() and not (tmp_path / "sweep.png").exists()
