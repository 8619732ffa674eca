"""``featcal-report``: a sweep, a run, or runs side by side, at a glance.

    featcal-report sweep DIR          table of every run under DIR (a Hydra multirun folder, or any folder holding
                                      runs) sorted by the average; writes DIR/sweep.csv and DIR/sweep.png
    featcal-report compare RUN...     the runs' models side by side (a run: its folder or its program_report.json);
                                      writes compare_drift.png (--out, default: the runs' common folder)
    featcal-report drift RUN          draws RUN/featcal_drift.png from its featcal_report.json
    featcal-report leaderboard run DIR [--rows ...] [--columns ...] [--method COLUMN=CONFIG]
                                   [--baseline-features streamed|replay|precomputed] -- POOL ARGS
                                      upstream mergers x post-merging methods on one pool, a fusion_bench run per
                                      cell (missing cells only); writes DIR/leaderboard.md, .csv and .png
    featcal-report leaderboard show DIR [--include CSV]
                                      the same files from the cells there are (and an earlier board's CSV)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import leaderboard
from .compare import compare
from .drift import DRIFT_PICTURE, write_drift_picture
from .runs import METHOD_REPORTS
from .sweep import NoRunsError, Sweep


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="featcal-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("sweep", help="a sweep's runs as one table, sweep.csv and sweep.png")
    sweep.add_argument("folder", type=Path)
    sweep.add_argument("--out", type=Path, help="where sweep.csv and sweep.png go (default: the folder)")
    comparison = commands.add_parser("compare", help="runs side by side")
    comparison.add_argument("runs", type=Path, nargs="+")
    comparison.add_argument("--out", type=Path)
    drift = commands.add_parser("drift", help="a FeatCal run's drift picture")
    drift.add_argument("run", type=Path)
    board = commands.add_parser("leaderboard", help="upstream mergers x post-merging methods on one pool")
    board.add_argument("action", choices=["run", "show"])
    board.add_argument("folder", type=Path)
    board.add_argument("--rows", help="name=config,... (FusionBench method configs; default: the CLIP rows: "
                       + ",".join(leaderboard.CLIP_ROWS) + ")")
    board.add_argument("--columns", default=",".join(leaderboard.COLUMNS), help="default: every column")
    board.add_argument("--method", action="append", default=[], metavar="COLUMN=CONFIG",
                       help="a post-merging column's method config (default: the CLIP ones, e.g. featcal=featcal/clip_ta)")
    board.add_argument("--baseline-features", choices=sorted(leaderboard.BASELINE_FEATURES), default="streamed",
                       help="Surgery's and ProbSurgery's features: streamed through both models every step (their "
                       "default), or replay: computed once and served in the streamed run's batches (the same maps to "
                       "float rounding, a fraction of the time; one feature row per example: CLIP and OpenCLIP), or "
                       "precomputed: computed once and resampled (other batches, another result; any family, T5's and "
                       "causal LMs' rows being tokens)")
    board.add_argument("--include", action="append", default=[], type=Path, metavar="CSV",
                       help="an earlier board's leaderboard.csv: its cells are shown where DIR has none (repeatable)")
    return parser


def _leaderboard(args) -> int:
    """The number of cells that failed (0 for show)."""
    failed = 0
    columns = [c for c in args.columns.split(",") if c]
    earlier = [leaderboard.read_csv(path) for path in args.include]  # read (and checked) before any cell runs
    if args.action == "run":
        methods = dict(leaderboard.CLIP_METHODS)
        for item in args.method:
            column, _, config = item.partition("=")
            if column not in methods or not config:
                raise ValueError(f"--method {item!r}: COLUMN=CONFIG with COLUMN one of {sorted(methods)}")
            methods[column] = config
        pool_args = args.pool_args
        if not any(a.startswith("modelpool=") for a in pool_args):
            raise ValueError("give the pool after --: modelpool=... taskpool=... (any fusion_bench arguments)")
        cells = leaderboard.plan(leaderboard.parse_rows(args.rows), columns, methods, pool_args, args.folder,
                                 args.baseline_features)
        counts = leaderboard.run_cells(cells, args.folder, leaderboard.fusion_bench_executable())
        print(", ".join(f"{v} {k}" for k, v in counts.items()) + " cell(s)")
        failed = counts["failed"]
    written = leaderboard.write(args.folder, columns, earlier)
    print(written[0].read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    return failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # fusion_bench's arguments after `--` are passed through untouched (argparse would read a `--rows`-like one)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:cut])
    args.pool_args = argv[cut + 1:]
    try:
        if args.command == "sweep":
            if not args.folder.is_dir():
                raise NoRunsError(f"{args.folder}: no such folder")
            sweep = Sweep(args.folder)
            print(sweep.markdown())
            csv_path, png = sweep.write(args.out)
            print(f"\nwrote {csv_path} and {png}" if png else f"\nwrote {csv_path} (no run has scores to draw)")
        elif args.command == "compare":
            text, picture = compare(args.runs, args.out)
            print(text)
            if picture is not None:
                print(f"\nwrote {picture}")
        elif args.command == "leaderboard":
            if _leaderboard(args):
                return 1  # the board is written from the cells that ran; a rerun tries the failed ones again
        else:
            folder = args.run.parent if args.run.is_file() else args.run
            report = folder / METHOD_REPORTS["featcal"]
            if not report.is_file():
                raise FileNotFoundError(f"{folder}: no {report.name} (a FeatCal run's folder)")
            print(write_drift_picture(json.loads(report.read_text()), folder / DRIFT_PICTURE))
    except (OSError, ValueError) as error:
        print(f"featcal-report {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
