"""``featcal-report``: a sweep, a run, or runs side by side, at a glance.

    featcal-report sweep DIR          table of every run under DIR (a Hydra multirun folder, or any folder holding
                                      runs) sorted by the average; writes DIR/sweep.csv and DIR/sweep.png
    featcal-report compare RUN...     the runs' models side by side (a run: its folder or its program_report.json);
                                      writes compare_drift.png (--out, default: the runs' common folder)
    featcal-report drift RUN          draws RUN/featcal_drift.png from its featcal_report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
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
