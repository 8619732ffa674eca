"""The results table that the quick start and the reproduction runner print."""

import json

import pytest

from featcal_fusionbench.integration import reporting


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
