"""A leaderboard of one model pool: upstream mergers (rows) x post-merging columns, each cell a ``fusion_bench`` run.

    featcal-report leaderboard run DIR [--rows ...] [--columns ...] -- modelpool=... taskpool=...
    featcal-report leaderboard show DIR [--include CSV]

``run`` makes every missing cell (a cell is a folder ``DIR/<row>/<column>`` holding the run's files; one whose
command and ``program_report.json`` are there is kept, so a rerun computes only what is missing) and then writes
``DIR/leaderboard.md``, ``.csv`` and ``.png``; ``show`` writes them from the cells there are. ``--include`` adds the
cells of an earlier board's CSV (a board made in several sittings, on machines that did not keep each other's run
folders) wherever DIR has no cell of its own.

Rows name a merger by its FusionBench config under ``method/`` (or ours under ``method/upstream/``): the upstream
cell runs it as ``method=upstream/<config>`` and saves the merged model, which the post-merging cells then start
from (``method.merged_model_path``), so every column calibrates the same merge. SVC (FusionBench's
``singular_value_calibration``, data-free) merges by itself: its cell runs FusionBench's SVC config for the row's
merger where FusionBench has one (else the cell is n/a), saves its output, and ``svc_featcal`` calibrates that.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from .processes import can_fork, fusion_bench_entry, run_forked
from .runs import points_scale, read_run

#: the board's rows on a CLIP vision pool: FusionBench 0.2.33's config for each merger (fusion_bench_config/method/...;
#: adamerging_clip and wudi are ours under method/upstream/: FusionBench's adamerging/clip is of the older `name:` form)
CLIP_ROWS: Dict[str, str] = {
    "task_arithmetic": "task_arithmetic", "simple_average": "simple_average", "ties": "ties_merging",
    "fisher": "fisher_merging/clip_fisher_merging", "regmean": "regmean/clip_regmean",
    "regmean_plusplus": "regmean_plusplus/clip_regmean_plusplus", "adamerging": "adamerging_clip", "wudi": "wudi",
    "tsv_m": "task_singular_vector/TaskSingularVectorMerging", "iso_c": "isotropic_merging/iso_c",
    "iso_cts": "isotropic_merging/iso_cts",
}
#: row -> FusionBench's SVC config over that merger (fusion_bench_config/method/singular_value_calibration/)
SVC_CONFIGS: Dict[str, str] = {
    "task_arithmetic": "task_arithmetic", "simple_average": "simple_average", "ties": "ties_merging",
    "wudi": "wudi", "tsv_m": "task_singular_vector", "iso_c": "iso_c", "iso_cts": "iso_cts",
}
COLUMNS = ("upstream", "svc", "surgery", "probsurgery", "featcal", "featcal_auto", "svc_featcal")
#: the post-merging columns' method configs on a CLIP pool (the paper's values; featcal_auto: the label-free choice)
CLIP_METHODS: Dict[str, str] = {"surgery": "surgery/clip_ta", "probsurgery": "probsurgery/clip_ta",
                                "featcal": "featcal/clip_ta", "featcal_auto": "featcal/auto_clip_ta",
                                "svc_featcal": "featcal/clip_ta"}
MERGED = "merged"  # a cell's saved model, beside its run's files
COMMAND = "command.txt"
COST = "cost.json"
PROGRAM_REPORT = "program_report.json"
OUTPUTS = ("leaderboard.md", "leaderboard.csv", "leaderboard.png")


@dataclass
class Cell:
    row: str
    column: str
    args: List[str] = field(default_factory=list)  # fusion_bench's arguments, the pool's appended
    source: Optional[str] = None  # the column whose saved model this cell starts from
    unavailable: Optional[str] = None  # why the cell is n/a


NO_SVC = "FusionBench has no SVC config over this merger"


def unavailable(row: str, column: str) -> Optional[str]:
    """Why the cell has no command (``plan``) and shows n/a (``absent``): an SVC column over a merger FusionBench has
    no SVC config for; None for every other cell."""
    return NO_SVC if column in ("svc", "svc_featcal") and row not in SVC_CONFIGS else None


#: post-merging column -> the column whose saved model it starts from
SOURCES: Dict[str, str] = {"surgery": "upstream", "probsurgery": "upstream", "featcal": "upstream",
                           "featcal_auto": "upstream", "svc_featcal": "svc"}
#: --baseline-features: the feature mode (option precompute_features) of these columns, Surgery and ProbSurgery
BASELINE_FEATURES = {"streamed": [], "replay": ["method.precompute_features=replay"],
                     "precomputed": ["method.precompute_features=true"]}
BASELINES = ("surgery", "probsurgery")


def plan(rows: Mapping[str, str], columns: Sequence[str], methods: Mapping[str, str], pool_args: Sequence[str],
         folder: Path, baseline_features: str = "streamed") -> List[Cell]:
    """Every cell's command, before anything runs; a bad row or column is refused here."""
    if baseline_features not in BASELINE_FEATURES:
        raise ValueError(f"baseline features {baseline_features!r}: one of {list(BASELINE_FEATURES)}")
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown or not columns:
        raise ValueError(f"unknown column(s) {unknown}; the columns are {list(COLUMNS)}")
    if not rows:
        raise ValueError("no rows: give --rows name=config,...")
    for name in rows:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"row name {name!r}: a folder name without '/'")
    cells = []
    for row, config in rows.items():
        merged = {c: str(Path(folder, row, c, MERGED).resolve()) for c in ("upstream", "svc")}
        for column in columns:
            cell = Cell(row, column, source=SOURCES.get(column), unavailable=unavailable(row, column))
            if cell.unavailable is not None:
                pass
            elif column == "upstream":
                cell.args = [f"method=upstream/{config}", f"merged_model_save_path={merged['upstream']}"]
            elif column == "svc":
                cell.args = [f"method=singular_value_calibration/{SVC_CONFIGS[row]}",
                             f"merged_model_save_path={merged['svc']}"]
            else:
                cell.args = [f"method={methods[column]}", f"method.merged_model_path={merged[cell.source]}"]
                if column in BASELINES:
                    cell.args += BASELINE_FEATURES[baseline_features]
            if cell.source is not None and cell.source not in columns and cell.unavailable is None:
                raise ValueError(f"column {column!r} starts from the {cell.source!r} cell's model: add that column")
            cell.args += list(pool_args)
            cells.append(cell)
    return cells


def cell_folder(folder: Path, cell: Cell) -> Path:
    return Path(folder, cell.row, cell.column)


def is_done(folder: Path, cell: Cell) -> bool:
    here = cell_folder(folder, cell)
    command = here / COMMAND
    return (command.is_file() and command.read_text() == shlex.join(cell.args)
            and (here / PROGRAM_REPORT).is_file())


def run_cells(cells: Sequence[Cell], folder: Path, executable: str, log=print) -> Dict[str, int]:
    """Run each missing cell in its folder (in the plan's order: a row's upstream before the cells that start from
    it); a cell whose source failed is skipped. Returns counts of made, kept and failed cells. Where ``executable``
    is this interpreter's ``fusion_bench``, each cell's process is forked from this one, which imports FusionBench
    once (``processes.py``: 8-13 s a cell on 2 cores otherwise); any other is started."""
    counts = {"made": 0, "kept": 0, "failed": 0, "unavailable": 0}
    failed = set()
    entry = None
    for cell in cells:
        if cell.unavailable:
            counts["unavailable"] += 1
            continue
        if is_done(folder, cell):
            counts["kept"] += 1
            continue
        if (cell.row, cell.source) in failed:
            failed.add((cell.row, cell.column))
            counts["failed"] += 1
            log(f"{cell.row} / {cell.column}: skipped, its {cell.source} cell failed")
            continue
        here = cell_folder(folder, cell)
        here.mkdir(parents=True, exist_ok=True)
        for stale in (here / COMMAND, here / PROGRAM_REPORT, here / COST):
            stale.unlink(missing_ok=True)
        args = [*cell.args, f"path.log_dir={here.resolve()}"]
        if entry is None and executable == _this_fusion_bench() and can_fork():
            started = time.perf_counter()
            entry = fusion_bench_entry()
            log(f"imported FusionBench once, {time.perf_counter() - started:.0f} s: each cell is forked from here")
        forked = entry is not None and can_fork()
        started = time.perf_counter()
        if forked:
            (here / "run.log").write_text("")  # run_forked appends
            returncode, usage = run_forked(entry, [executable, *args], here, here / "run.log", here / "run.log")
        else:
            with open(here / "run.log", "w") as out:
                process = subprocess.Popen([executable, *args], cwd=here, stdout=out, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(process.pid, 0)
            returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        if returncode != 0 or not (here / PROGRAM_REPORT).is_file():
            failed.add((cell.row, cell.column))
            counts["failed"] += 1
            log(f"{cell.row} / {cell.column}: failed (exit {returncode}), see {here / 'run.log'}")
            continue
        (here / COST).write_text(json.dumps({"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024,
                                             "forked": forked}))
        (here / COMMAND).write_text(shlex.join(cell.args))
        counts["made"] += 1
        log(f"{cell.row} / {cell.column}: {seconds:.0f} s")
    return counts


def read_board(folder: Path) -> Dict[str, Dict[str, dict]]:
    """row -> column -> {average, tasks, seconds, calibration_seconds, peak_rss_bytes}, from the cells on disk."""
    board: Dict[str, Dict[str, dict]] = {}
    for row_dir in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        for column in COLUMNS:
            here = row_dir / column
            if not (here / PROGRAM_REPORT).is_file():
                continue
            run = read_run(here)
            if run.problem:
                continue
            scores = dict(run.scores)
            scale = points_scale([scores])
            cost = json.loads((here / COST).read_text()) if (here / COST).is_file() else {}
            board.setdefault(row_dir.name, {})[column] = {
                "average": scores.pop("average") * scale, "tasks": {t: v * scale for t, v in scores.items()},
                "seconds": cost.get("seconds"), "calibration_seconds": run.seconds,
                "peak_rss_bytes": cost.get("peak_rss_bytes"),
            }
    return board


CSV_FIXED = ("upstream", "column", "average")
CSV_COSTS = ("calibration_seconds", "seconds", "peak_rss_gib")


def read_csv(path: Path) -> Dict[str, Dict[str, dict]]:
    """An earlier board's cells from its CSV (``write_csv``'s layout), as ``read_board`` gives them."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        if tuple(header[:3]) != CSV_FIXED or tuple(header[-3:]) != CSV_COSTS:
            raise ValueError(f"{path}: not a leaderboard CSV (its header should start with {', '.join(CSV_FIXED)} and "
                             f"end with {', '.join(CSV_COSTS)}; got {', '.join(header)})")
        tasks = header[3:-3]
        board: Dict[str, Dict[str, dict]] = {}
        for line in reader:
            number = lambda key: float(line[key]) if line[key] else None  # noqa: E731
            rss = number("peak_rss_gib")
            board.setdefault(line["upstream"], {})[line["column"]] = {
                "average": float(line["average"]),
                "tasks": {t: float(line[t]) for t in tasks if line[t]},
                "seconds": number("seconds"), "calibration_seconds": number("calibration_seconds"),
                "peak_rss_bytes": None if rss is None else rss * 2**30,
            }
    return board


def with_included(board: Dict[str, Dict[str, dict]], earlier: Sequence[Mapping[str, Mapping[str, dict]]]):
    """``board`` with every cell of the ``earlier`` boards that it lacks (its own cells win), rows by name."""
    merged = {row: dict(cells) for row, cells in board.items()}
    for other in earlier:
        for row, cells in other.items():
            for column, cell in cells.items():
                merged.setdefault(row, {}).setdefault(column, cell)
    return {row: merged[row] for row in sorted(merged)}


def best_cells(board: Mapping[str, Mapping[str, dict]], columns: Sequence[str]):
    """(row -> its best column, the best (row, column) overall), among the ``columns`` shown: a cell of a column
    left out (``--columns``) is neither marked nor lets a shown one go unmarked."""
    per_row = {row: max((c for c in cells if c in columns), key=lambda c: cells[c]["average"])
               for row, cells in board.items() if any(c in columns for c in cells)}
    overall = max(per_row.items(), key=lambda rc: board[rc[0]][rc[1]]["average"], default=None)
    return per_row, overall


#: a cell with no finished run: FusionBench cannot make it, or it is not made (yet, or it failed)
UNAVAILABLE, NOT_MADE = "n/a", "-"
ABSENT_NOTE = (f"{UNAVAILABLE}: {NO_SVC}; {NOT_MADE}: no finished run in this folder (not made yet, or it failed: "
               "see its run.log)")


def absent(row: str, column: str) -> str:
    """What a cell without a finished run shows: n/a where ``plan`` makes no command for it, else not made."""
    return UNAVAILABLE if unavailable(row, column) else NOT_MADE


def markdown(board: Mapping[str, Mapping[str, dict]], columns: Sequence[str]) -> str:
    per_row, overall = best_cells(board, columns)
    lines = ["| upstream merger | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for row, cells in board.items():
        shown = []
        for column in columns:
            if column not in cells:
                shown.append(absent(row, column))
                continue
            text = f"{cells[column]['average']:.1f}"
            if per_row.get(row) == column:
                text = f"**{text}**"
            if overall == (row, column):
                text += " (best)"
            shown.append(text)
        lines.append(f"| {row} | " + " | ".join(shown) + " |")
    if any(c not in cells for cells in board.values() for c in columns):
        lines += ["", ABSENT_NOTE]
    return "\n".join(lines) + "\n"


def write_csv(board: Mapping[str, Mapping[str, dict]], path: Path) -> None:
    tasks = sorted({t for cells in board.values() for cell in cells.values() for t in cell["tasks"]})
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow([*CSV_FIXED, *tasks, *CSV_COSTS])
        for row, cells in board.items():
            for column, cell in cells.items():
                rss = cell["peak_rss_bytes"]
                writer.writerow([row, column, f"{cell['average']:.4f}", *(_fmt(cell["tasks"].get(t)) for t in tasks),
                                 _fmt(cell["calibration_seconds"]), _fmt(cell["seconds"]),
                                 _fmt(None if rss is None else rss / 2**30)])


def _fmt(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def figure(board: Mapping[str, Mapping[str, dict]], columns: Sequence[str]):
    """A heatmap of the averages; each row's best cell boxed, the best overall starred, cells without a run blank
    (marked n/a or not made, as in the table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    rows = list(board)
    values = np.array([[board[r][c]["average"] if c in board[r] else math.nan for c in columns] for r in rows])
    fig, ax = plt.subplots(figsize=(1.4 * len(columns) + 2.5, 0.55 * len(rows) + 1.8))
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label="average accuracy")
    ax.set_xticks(range(len(columns)), labels=columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), labels=rows)
    per_row, overall = best_cells(board, columns)
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            value = values[i, j]
            # dark text on the colour map's bright end, light on its dark end
            color = "grey" if math.isnan(value) else "black" if image.norm(value) > 0.6 else "white"
            text = absent(row, column) if math.isnan(value) else f"{value:.1f}"
            ax.text(j, i, text, ha="center", va="center", color=color, fontsize=8)
        if row in per_row:
            j = columns.index(per_row[row])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    if overall is not None:
        ax.plot(columns.index(overall[1]) + 0.32, rows.index(overall[0]) - 0.25, marker="*", color="gold",
                markersize=14, markeredgecolor="black")
    ax.set_title("average accuracy: each row's best boxed, the best overall starred")
    fig.tight_layout()
    return fig


def write(folder: Path, columns: Sequence[str] = COLUMNS,
          earlier: Sequence[Mapping[str, Mapping[str, dict]]] = ()) -> List[Path]:
    """The board's files from the cells in ``folder`` and, where it has none, those of ``earlier`` boards
    (``read_csv``'s, read before this board's own CSV is written over)."""
    board = with_included(read_board(folder) if Path(folder).is_dir() else {}, earlier)
    if not board:
        raise ValueError(f"{folder}: no finished cell (a folder <row>/<column> with a {PROGRAM_REPORT})")
    Path(folder).mkdir(parents=True, exist_ok=True)
    shown = [c for c in columns if any(c in cells for cells in board.values())]
    md, table, png = (Path(folder, name) for name in OUTPUTS)
    md.write_text(markdown(board, shown))
    write_csv(board, table)
    fig = figure(board, shown)
    fig.savefig(png, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return [md, table, png]


def parse_rows(text: Optional[str]) -> Dict[str, str]:
    """``name=config,...``; a bare name is a CLIP row's (``ties``) or a config naming itself; default: the CLIP rows."""
    if not text:
        return dict(CLIP_ROWS)
    rows = {}
    for item in text.split(","):
        name, _, config = (part.strip() for part in item.partition("="))
        rows[name] = config or CLIP_ROWS.get(name, name)
    return rows


def _this_fusion_bench() -> str:
    return str(Path(sys.executable).with_name("fusion_bench"))


def fusion_bench_executable() -> str:
    beside = _this_fusion_bench()
    return beside if Path(beside).exists() else "fusion_bench"
