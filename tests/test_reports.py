"""``featcal-report`` on a real multirun of the toy world (2 x 2 values), checked against each run's own reports;
the pictures decoded and checked for what they show."""

import json
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from featcal_fusionbench.reports.compare import compare  # noqa: E402
from featcal_fusionbench.reports.drift import DRIFT_PICTURE, drift_figure, write_drift_picture  # noqa: E402
from featcal_fusionbench.reports.sweep import BEST_MARK, Sweep  # noqa: E402
from shared_builds import built_once  # noqa: E402
from test_cli import fusion_bench, toy_args  # noqa: E402

import commands  # noqa: E402

pytestmark = pytest.mark.slow  # one fusion_bench multirun, four jobs


@pytest.fixture(scope="module")
def sweep_dir(toy_world, tmp_path_factory, worker_id):
    """The multirun, made once for every worker: the tests read it, and those that write there work on a copy."""
    def build(cwd):
        fusion_bench("-m", *toy_args(toy_world, "method=featcal", "method.lambda_=1e-6,1e-3", "method.rho=1.0,2.0"),
                     cwd=cwd)

    folder = built_once(tmp_path_factory, worker_id, "sweep", build)
    (sweep,) = (folder / "outputs" / "multirun" / "fabric_model_fusion").iterdir()
    return sweep


def report(sweep_dir, job, name="program_report.json"):
    return json.loads((sweep_dir / str(job) / name).read_text())


def picture(path):
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


def run_cli(*args, cwd=None):
    return commands.run("featcal-report", *args, cwd=cwd, timeout=300)


def test_the_sweep_table_is_each_runs_own_report_sorted_by_the_average(sweep_dir, tmp_path):
    shutil.copytree(sweep_dir, tmp_path / "sweep")  # written into by default
    sweep_dir = tmp_path / "sweep"
    result = run_cli("sweep", sweep_dir)
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = [c.strip() for c in rows[0]], [[c.strip() for c in r] for r in rows[1:]]
    assert header[:4] == ["run", "method.lambda_", "method.rho", "average"]
    assert len(body) == 4
    averages = [float(r[3]) for r in body]
    assert averages == sorted(averages, reverse=True)
    assert body[0][-1] == BEST_MARK and all(r[-1] == "" for r in body[1:])
    for row in body:
        job, own = row[0], report(sweep_dir, row[0])
        hparams = report(sweep_dir, job, "featcal_report.json")["hparams"]
        assert (float(row[1]), float(row[2])) == (hparams["lambda_"], hparams["rho"])
        assert float(row[3]) == pytest.approx(100 * own["average"]["accuracy"], abs=0.0051)
        for task, cell in zip(header[4:], row[4:]):
            if task.startswith("toy_"):
                assert float(cell) == pytest.approx(100 * own[task]["accuracy"], abs=0.0051)
        assert float(row[header.index("calibration (s)")]) == pytest.approx(
            report(sweep_dir, job, "featcal_report.json")["seconds"], abs=0.05)
    lines = (sweep_dir / "sweep.csv").read_text().splitlines()
    assert lines[0].startswith("run,status,method.lambda_,method.rho,average,toy_0") and len(lines) == 5


def test_the_sweep_picture_is_a_heatmap_per_task_with_the_best_cell_marked(sweep_dir):
    fig = Sweep(sweep_dir).figure()
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    tasks = [t for t in report(sweep_dir, 0) if t.startswith("toy_")]
    assert [ax.get_title() for ax in visible] == ["average", *tasks]  # then a panel per task
    average = visible[0]
    assert average.get_title() == "average"
    assert (average.get_xlabel(), average.get_ylabel()) == ("method.rho", "method.lambda_")
    grid = average.images[0].get_array()
    assert grid.shape == (2, 2)
    hparams = {job: report(sweep_dir, job, "featcal_report.json")["hparams"] for job in range(4)}
    for i, lam in enumerate((1e-6, 1e-3)):  # rows: lambda, columns: rho, both ascending
        for j, rho in enumerate((1.0, 2.0)):
            (job,) = [k for k, hp in hparams.items() if (hp["lambda_"], hp["rho"]) == (lam, rho)]
            assert grid[i, j] == pytest.approx(100 * report(sweep_dir, job)["average"]["accuracy"])
    best = [p for p in average.patches if p.get_label() == "best"]
    assert len(best) == 1
    i, j = np.unravel_index(np.argmax(np.asarray(grid)), grid.shape)
    assert best[0].get_xy() == (j - 0.5, i - 0.5)


def test_a_run_without_scores_is_listed_as_failed_and_the_picture_changes(sweep_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sweep_dir, copy)
    assert run_cli("sweep", copy).returncode == 0
    before = picture(copy / "sweep.png")
    (copy / "2" / "program_report.json").unlink()
    result = run_cli("sweep", copy)
    assert result.returncode == 0, result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(failed) == 1 and "failed" in failed[0] and "no program_report.json" in failed[0]
    assert "3 runs scored, 1 failed" in result.stdout
    after = picture(copy / "sweep.png")
    assert before.shape != after.shape or not np.array_equal(before, after)


def test_a_folder_without_runs_exits_nonzero_with_one_line(tmp_path):
    for folder in (tmp_path, tmp_path / "missing"):
        result = run_cli("sweep", folder)
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1
        assert "no runs here" in result.stderr or "no such folder" in result.stderr
        assert "Traceback" not in result.stderr


def test_each_run_draws_its_drift_per_block_and_two_runs_differ(sweep_dir):
    images = []
    for job in (0, 3):
        own = report(sweep_dir, job, "featcal_report.json")
        fig = drift_figure(own)
        (ax,) = fig.axes
        tasks = list(own["blocks"][0]["drift"])
        assert len(ax.lines) == 2 * len(tasks)  # per task: the uncalibrated block and the calibrated one
        calibrated = [line for line in ax.lines if line.get_label().endswith(", calibrated")]
        for line, task in zip(calibrated, tasks):
            assert list(line.get_ydata()) == pytest.approx([b["drift"][task]["after"]["l2"] for b in own["blocks"]])
        assert ax.get_xlabel() == "block" and "L2" in ax.get_ylabel()
        assert f"lambda {own['hparams']['lambda_']:g}" in fig._suptitle.get_text()
        images.append(picture(sweep_dir / str(job) / DRIFT_PICTURE))
    assert images[0].shape != images[1].shape or not np.array_equal(*images)


def test_an_auto_select_run_gets_a_panel_of_its_choices():
    blocks = [{"block": i, "hparams": {"lambda_": 10.0 ** -i, "rho": 1.0 + i, "alpha": 0.3},
               "drift": {"a": {"before": {"l2": 2.0}, "after": {"l2": 1.0}, "upstream": {"l2": 3.0}}}} for i in range(3)]
    fig = drift_figure({"blocks": blocks, "hparams": {"lambda_": 0.05}, "upstream": "TaskArithmeticAlgorithm"})
    drift, chosen = fig.axes
    assert [line.get_label() for line in drift.lines] == ["a, upstream", "a, calibrated"]
    assert [line.get_label() for line in chosen.lines] == ["lambda", "rho"]
    assert list(chosen.lines[0].get_ydata()) == [1.0, 0.1, 0.01]
    assert not chosen.collections, "no block at an edge: nothing ringed"


def test_the_choice_panel_rings_the_blocks_at_a_grid_edge_and_marks_the_kept_ones(tmp_path):
    """Block 2's lambda at the numerical floor and block 0's rho at its grid's high edge are ringed; block 1,
    which kept the method's values within the noise, is marked; the picture is written and decodes."""
    selections = [{"edge": ["rho at the grid's high edge"]}, {"kept": "method"},
                  {"edge": ["lambda at the numerical floor"], "widened": {"lambda_": [1e-7]}}]
    blocks = [{"block": i, "hparams": {"lambda_": 10.0 ** -(3 * i), "rho": 2.5, "alpha": 0.3},
               "selection": selections[i], "drift": {"a": {"before": {"l2": 2.0}, "after": {"l2": 1.0}}}}
              for i in range(3)]
    report = {"blocks": blocks, "hparams": {"lambda_": 0.05}, "upstream": "TaskArithmeticAlgorithm"}
    fig = drift_figure(report)
    chosen = fig.axes[1]
    marks = {c.get_label(): c.get_offsets().tolist() for c in chosen.collections}
    assert marks == {"lambda at a grid edge": [[2.0, 1e-6]], "rho at a grid edge": [[0.0, 2.5]],
                     "the method's values kept (within the noise)": [[1.0, 1e-3]]}
    assert {t.get_text() for t in chosen.get_legend().get_texts()} >= set(marks)
    path = write_drift_picture(report, tmp_path / "drift.png")
    assert picture(path).shape[2] in (3, 4)


def test_compare_puts_runs_side_by_side_and_their_drift_on_one_picture(sweep_dir, tmp_path):
    text, png = compare([sweep_dir / "0", sweep_dir / "3" / "program_report.json"], out=tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| TaskArithmetic + FeatCal")]
    assert len(rows) == 2
    assert rows[0].split("|")[-2].strip() == f"{100 * report(sweep_dir, 0)['average']['accuracy']:.1f}"
    assert png == tmp_path / "compare_drift.png"
    picture(png)
