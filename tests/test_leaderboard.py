"""featcal-report leaderboard: the board's plan (every cell's fusion_bench command, before anything runs), its
resume (a removed cell is the only one made again), and its table, CSV and picture (decoded and read back)."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from featcal_fusionbench.reports import leaderboard
from featcal_fusionbench.reports.cli import main as report_main

POOL = ["modelpool=CLIPVisionModelPool/x", "taskpool=CLIPVisionModelTaskPool/x"]

# A stand-in for the fusion_bench executable: writes a program report into path.log_dir whose accuracies depend on
# the method and the model it starts from, and the merged model folder where asked; every call logged.
FAKE = '''#!{python}
import json, sys, pathlib
args = dict(a.split("=", 1) for a in sys.argv[1:])
log_dir = pathlib.Path(args["path.log_dir"])
with open({calls!r}, "a") as calls:
    calls.write(log_dir.parent.name + "/" + log_dir.name + "\\n")
if "fail" in args["method"]:
    sys.exit(1)
score = {{"upstream/task_arithmetic": 0.60, "upstream/ties_merging": 0.65}}.get(args["method"], 0.0)
score += {{"featcal/clip_ta": 0.2, "surgery/clip_ta": 0.1}}.get(args["method"], 0.0)
source = args.get("method.merged_model_path")
if source:
    score += json.loads((pathlib.Path(source) / "score.json").read_text())
if "merged_model_save_path" in args:
    saved = pathlib.Path(args["merged_model_save_path"])
    saved.mkdir(parents=True)
    (saved / "score.json").write_text(json.dumps(score))
tasks = {{"a": score, "b": score - 0.1}}
report = {{t: {{"accuracy": v}} for t, v in tasks.items()}}
report["average"] = {{"accuracy": sum(tasks.values()) / 2}}
(log_dir / "program_report.json").write_text(json.dumps(report))
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    calls = tmp_path / "calls.txt"
    executable = tmp_path / "fusion_bench"
    executable.write_text(FAKE.format(python=sys.executable, calls=str(calls)))
    executable.chmod(0o755)
    monkeypatch.setattr(leaderboard, "fusion_bench_executable", lambda: str(executable))
    return calls


def made(calls):
    return calls.read_text().split() if calls.is_file() else []


def test_the_plan_runs_each_merger_by_its_config_and_calibrates_its_saved_model(tmp_path):
    rows = leaderboard.parse_rows("task_arithmetic,regmean_plusplus,mine=isotropic_merging/iso_c")
    assert rows == {"task_arithmetic": "task_arithmetic", "regmean_plusplus": "regmean_plusplus/clip_regmean_plusplus",
                    "mine": "isotropic_merging/iso_c"}
    cells = {(c.row, c.column): c for c in leaderboard.plan(rows, leaderboard.COLUMNS, leaderboard.CLIP_METHODS,
                                                            POOL, tmp_path)}
    upstream = cells["regmean_plusplus", "upstream"]
    saved = str((tmp_path / "regmean_plusplus" / "upstream" / "merged").resolve())
    assert upstream.args == ["method=upstream/regmean_plusplus/clip_regmean_plusplus",
                             f"merged_model_save_path={saved}", *POOL]
    assert cells["regmean_plusplus", "featcal_auto"].args[:2] == ["method=featcal/auto_clip_ta",
                                                                 f"method.merged_model_path={saved}"]
    assert cells["regmean_plusplus", "svc"].unavailable and cells["regmean_plusplus", "svc_featcal"].unavailable
    assert cells["task_arithmetic", "svc"].args[0] == "method=singular_value_calibration/task_arithmetic"
    assert cells["task_arithmetic", "svc_featcal"].args[1].endswith("task_arithmetic/svc/merged")
    with pytest.raises(ValueError, match="unknown column"):
        leaderboard.plan(rows, ["upstream", "featcal_v2"], leaderboard.CLIP_METHODS, POOL, tmp_path)
    with pytest.raises(ValueError, match="add that column"):
        leaderboard.plan(rows, ["featcal"], leaderboard.CLIP_METHODS, POOL, tmp_path)


def test_a_rerun_makes_only_the_missing_cells_and_a_failed_source_skips_its_dependents(tmp_path, fake, capsys):
    board = tmp_path / "board"
    argv = ["leaderboard", "run", str(board), "--rows", "task_arithmetic,ties,broken=fail_merging",
            "--columns", "upstream,surgery,featcal", "--", *POOL]
    assert report_main(argv) == 1  # a cell failed: the board is written from the others
    assert sorted(made(fake)) == sorted(["task_arithmetic/upstream", "task_arithmetic/surgery", "task_arithmetic/featcal",
                                         "ties/upstream", "ties/surgery", "ties/featcal", "broken/upstream"])
    assert "3 failed" in capsys.readouterr().out  # broken/upstream, and its surgery and featcal skipped
    fake.unlink()
    import shutil

    shutil.rmtree(board / "ties" / "featcal")
    assert report_main(argv) == 1
    assert made(fake) == ["ties/featcal", "broken/upstream"]  # the removed cell, and the failed one tried again
    table = {(r["upstream"], r["column"]): r for r in csv.DictReader(open(board / "leaderboard.csv"))}
    assert float(table["ties", "featcal"]["average"]) == pytest.approx(100 * (0.65 + 0.2 + 0.65 + 0.2 - 0.1) / 2)
    assert float(table["ties", "featcal"]["a"]) == pytest.approx(85.0)
    assert float(table["ties", "featcal"]["peak_rss_gib"]) > 0 and float(table["ties", "featcal"]["seconds"]) > 0
    text = (board / "leaderboard.md").read_text()
    assert "| ties | 60.0 | 70.0 | **80.0** (best) |" in text and "| task_arithmetic | 55.0 | 65.0 | **75.0** |" in text
    assert "broken" not in text


def test_the_picture_is_a_heatmap_with_each_rows_best_boxed_and_the_best_starred(tmp_path):
    import matplotlib.image

    def cell(average):
        return {"average": average, "tasks": {}, "seconds": 1.0, "calibration_seconds": None, "peak_rss_bytes": 1}

    board = {"ta": {"upstream": cell(50.0), "featcal": cell(70.0)}, "ties": {"upstream": cell(80.0)},
             "fisher": {"upstream": cell(60.0)}}
    fig = leaderboard.figure(board, ["upstream", "featcal", "svc"])
    ax = fig.axes[0]
    # an SVC cell is n/a where plan() makes none (SVC_CONFIGS has no row "ta" nor "fisher"); the others are not made
    assert [t.get_text() for t in ax.texts] == ["50.0", "70.0", "n/a", "80.0", "-", "-", "60.0", "-", "n/a"]
    boxes = [(p.get_x(), p.get_y()) for p in ax.patches]
    assert boxes == [(0.5, -0.5), (-0.5, 0.5), (-0.5, 1.5)]  # ta's best: featcal; ties's, fisher's: upstream
    (star,) = ax.lines
    assert star.get_marker() == "*" and round(float(star.get_ydata()[0])) == 1 - 0  # on the ties row
    path = tmp_path / "board.png"
    fig.savefig(path, dpi=60)
    pixels = matplotlib.image.imread(path)[..., :3]
    red = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.2) & (pixels[..., 2] < 0.2)
    gold = (pixels[..., 0] > 0.8) & (pixels[..., 1] > 0.6) & (pixels[..., 2] < 0.2)
    assert red.sum() > 50 and gold.sum() > 10 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20


def test_columns_left_out_are_neither_shown_nor_marked_best():
    """`--columns upstream,featcal_auto` over a folder whose rows also hold Surgery cells (the best of their rows):
    the table and picture mark the best of the columns shown."""
    def cell(average):
        return {"average": average, "tasks": {"a": average}, "seconds": 1.0, "calibration_seconds": None,
                "peak_rss_bytes": 1}

    board = {"ta": {"upstream": cell(40.0), "surgery": cell(60.0), "featcal_auto": cell(58.0)},
             "ties": {"upstream": cell(36.0), "surgery": cell(56.0)}}
    shown = ["upstream", "featcal_auto"]
    text = leaderboard.markdown(board, shown)
    assert "| ta | 40.0 | **58.0** (best) |" in text and "| ties | **36.0** | - |" in text
    assert text.endswith(f"\n\n{leaderboard.ABSENT_NOTE}\n")
    ax = leaderboard.figure(board, shown).axes[0]
    assert [(p.get_x(), p.get_y()) for p in ax.patches] == [(0.5, -0.5), (-0.5, 0.5)]


def test_replayed_baseline_features_change_only_the_baselines_cells(tmp_path, fake, capsys):
    """--baseline-features replay: Surgery's and ProbSurgery's cells run with precompute_features=replay (their
    command changes, so a board made streamed makes those cells again, and only those); precomputed: with
    precompute_features=true."""
    rows = leaderboard.parse_rows("task_arithmetic")
    cells = {c.column: c for c in leaderboard.plan(rows, leaderboard.COLUMNS, leaderboard.CLIP_METHODS, POOL, tmp_path,
                                                   "replay")}
    streamed = {c.column: c for c in leaderboard.plan(rows, leaderboard.COLUMNS, leaderboard.CLIP_METHODS, POOL,
                                                      tmp_path)}
    for column in leaderboard.COLUMNS:
        replay = ["method.precompute_features=replay"] if column in ("surgery", "probsurgery") else []
        assert cells[column].args == [*streamed[column].args[:-len(POOL)], *replay, *POOL], column
    board = tmp_path / "board"
    argv = ["leaderboard", "run", str(board), "--rows", "task_arithmetic", "--columns", "upstream,surgery,probsurgery,featcal"]
    assert report_main([*argv, "--", *POOL]) == 0
    fake.unlink()
    assert report_main([*argv, "--baseline-features", "replay", "--", *POOL]) == 0
    assert sorted(made(fake)) == ["task_arithmetic/probsurgery", "task_arithmetic/surgery"]
    precomputed = {c.column: c for c in leaderboard.plan(rows, leaderboard.COLUMNS, leaderboard.CLIP_METHODS, POOL,
                                                         tmp_path, "precomputed")}
    for column in leaderboard.COLUMNS:
        option = ["method.precompute_features=true"] if column in ("surgery", "probsurgery") else []
        assert precomputed[column].args == [*streamed[column].args[:-len(POOL)], *option, *POOL], column
    with pytest.raises(ValueError, match="baseline features 'cached'"):
        leaderboard.plan(rows, leaderboard.COLUMNS, leaderboard.CLIP_METHODS, POOL, tmp_path, "cached")


def test_bad_leaderboard_arguments_are_refused_before_any_cell_runs(tmp_path, fake, capsys):
    assert report_main(["leaderboard", "run", str(tmp_path / "b"), "--columns", "upstream,nope", "--", *POOL]) == 1
    assert report_main(["leaderboard", "run", str(tmp_path / "b"), "--columns", "upstream"]) == 1
    assert report_main(["leaderboard", "show", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown column(s) ['nope']" in err and "give the pool after --" in err and "no finished cell" in err
    assert not made(fake) and not (tmp_path / "b").exists()


def test_an_earlier_boards_csv_fills_the_cells_this_folder_lacks_and_its_own_cells_win(tmp_path, fake, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert report_main(["leaderboard", "run", str(first), "--rows", "task_arithmetic,ties", "--columns",
                        "upstream,featcal", "--", *POOL]) == 0
    lines = list(csv.DictReader(open(first / "leaderboard.csv")))
    earlier = {(r["upstream"], r["column"]): dict(r) for r in lines}
    for line in lines:  # an earlier board whose ties cell a rerun replaces
        if (line["upstream"], line["column"]) == ("ties", "featcal"):
            line["average"] = "99.0000"
    with open(first / "leaderboard.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)
    assert report_main(["leaderboard", "run", str(second), "--rows", "ties", "--columns", "upstream,featcal",
                        "--include", str(first / "leaderboard.csv"), "--", *POOL]) == 0
    table = {(r["upstream"], r["column"]): r for r in csv.DictReader(open(second / "leaderboard.csv"))}
    assert sorted(table) == sorted(earlier)
    assert table["ties", "featcal"]["average"] == earlier["ties", "featcal"]["average"]  # its own cell, not 99
    assert table["task_arithmetic", "featcal"] == earlier["task_arithmetic", "featcal"]  # the CSV's, every field
    assert "| task_arithmetic | 55.0 | **75.0** |" in (second / "leaderboard.md").read_text()
    calls = made(fake)
    assert report_main(["leaderboard", "show", str(second), "--include", str(tmp_path / "nope.csv")]) == 1
    (tmp_path / "other.csv").write_text("row,value\n")
    assert report_main(["leaderboard", "run", str(tmp_path / "third"), "--include", str(tmp_path / "other.csv"),
                        "--", *POOL]) == 1
    err = capsys.readouterr().err
    assert "nope.csv" in err and "not a leaderboard CSV" in err
    assert made(fake) == calls and not (tmp_path / "third").exists()


@pytest.mark.slow
def test_a_board_forks_its_cells_from_one_import_and_each_is_the_run_fusion_bench_makes(tmp_path, toy_world):
    """The real fusion_bench: the board imports it once and forks each cell (featcal_fusionbench/processes.py); the
    calibrated cell scores what the same command scores as a process of its own."""
    import shlex

    import commands

    method = tmp_path / "config" / "method" / "featcal" / "toy_ta.yaml"  # the paper's config, the toy's 64 examples
    method.parent.mkdir(parents=True)
    method.write_text("defaults:\n  - /method/featcal/clip_ta@_here_\n  - _self_\nnum_calibration_examples: 16\n")
    pool = [f"hydra.searchpath=[file://{toy_world['config_dir']},file://{tmp_path / 'config'}]",
            "modelpool=CLIPVisionModelPool/toy", "taskpool=CLIPVisionModelTaskPool/toy"]
    board = tmp_path / "board"
    done = commands.run("featcal-report", "leaderboard", "run", str(board), "--rows", "task_arithmetic",
                        "--columns", "upstream,featcal", "--method", "featcal=featcal/toy_ta", "--", *pool,
                        cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "imported FusionBench once" in done.stdout and "2 made" in done.stdout
    cell = board / "task_arithmetic" / "featcal"
    cost = json.loads((cell / "cost.json").read_text())
    assert cost["forked"] is True and cost["seconds"] > 0 and cost["peak_rss_bytes"] > 0
    direct = commands.run("fusion_bench", *shlex.split((cell / "command.txt").read_text()),
                          f"path.log_dir={tmp_path / 'direct'}", cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in (cell / "program_report.json", tmp_path / "direct" / "program_report.json")]
    assert reports[0] == reports[1] and reports[0]["average"]["accuracy"] > 0
