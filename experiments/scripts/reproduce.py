"""The paper's tables as `fusion_bench` commands: list them, run them (resumably), render paper / ours / diff.

Usage:
  python experiments/scripts/reproduce.py --table 1 --list                 # one line per command, with its row
  python experiments/scripts/reproduce.py --table 1                        # run Table 1 (skips runs whose report exists)
  python experiments/scripts/reproduce.py --table 2 --rows '*/ta+featcal'  # a subset (ids, prefixes, globs, method names)
  python experiments/scripts/reproduce.py --table I --list                 # App. I (Tables 7-11); also --table all, --table 1,3
  python experiments/scripts/reproduce.py --table 1 --render-only          # tables from the runs so far
  python experiments/scripts/reproduce.py --table all --estimate experiments/results/benchmarks/rows_cuda.json  # each table's time on the
                                                               # device that experiments/scripts/bench_rows.py measured
  python experiments/scripts/reproduce.py --table 1 --world offline --rows ta,ta+featcal \\
      --override method.num_calibration_examples=16            # the offline CLIP world, a cheap smoke run

Tables: 1 (CLIP-ViT-B/32, 8 tasks), 2 (extended averages: L/14 8 tasks, B/32 and L/14 on 14 and 20 tasks),
3 (FLAN-T5-base and -large on GLUE), 4 (MergeBench: Llama-3.2-3B and Llama-3.1-8B-Instruct, scored with lm-eval), 7-11 (App. I: the per-task tables behind Table 2), 12 (the sample budget:
each calibrator after Task Arithmetic at n = 8 ... 512 examples per task, three seeds; also drawn as Fig. 3). Every row is a FusionBench
run in its own folder under --out: each upstream merger (Simple Averaging, Task Arithmetic, AdaMerging, WUDI) runs
once, is evaluated, and saves its merged model (AdaMerging also its merging weights); Surgery, ProbSurgery and
FeatCal then start from that saved model (`method.merged_model_path`). A run whose result exists with the same
command is skipped, so an interrupted invocation resumes. Rendered tables go to OUT/tables/table_N.{md,tex,csv}.
`--world offline` maps Tables 1 and 12 to the offline CLIP world, Table 3's base rows to the offline text world and
Table 4's 3B block to the offline LLM world, whose sample budget is Table 12-llm (n = 8, 32, 128; not a table of the
paper); the other rows have no offline world and are listed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from featcal_experiments.reproduce.catalog import Catalog, CatalogError, list_lines, parse_tables


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="append", required=True,
                        help="1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 12-llm (the offline LLM world's sample budget), I (Tables 7-11) "
                             "or all; repeat or comma-separate")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row ids, id prefixes, globs or method names (default: every row)")
    parser.add_argument("--world", choices=["hub", "offline"], default="hub")
    parser.add_argument("--out", type=Path, default=None, help="runs folder (default outputs/reproduce/WORLD)")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    parser.add_argument("--render-only", action="store_true", help="render the tables from existing runs only")
    parser.add_argument("--estimate", type=Path, metavar="BENCH_JSON",
                        help="print each table's estimated time from experiments/scripts/bench_rows.py's JSON and exit")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="Hydra override for the calibrator runs (Surgery, ProbSurgery, FeatCal); "
                             "CALIBRATOR:KEY=VALUE for one of them (e.g. surgery:method.precompute_features=true); "
                             "repeatable")
    parser.add_argument("--override-all", action="append", default=[], metavar="KEY=VALUE",
                        help="Hydra override for every run; repeatable")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sum(map(bool, (args.list, args.render_only, args.estimate))) > 1:
        parser.error("--list, --render-only and --estimate exclude each other")
    out = args.out or Path("outputs") / "reproduce" / args.world
    try:
        tables = parse_tables(args.table)
        catalog = Catalog(args.world, out, args.override, args.override_all)
        patterns = [p for p in (args.rows or "").split(",") if p.strip()] or None
        rows = catalog.select(tables, patterns)
    except CatalogError as error:
        parser.error(str(error))
    if args.list:
        try:
            for line in list_lines(rows):
                print(line)
            sys.stdout.flush()
        except BrokenPipeError:  # `... --list | head`
            sys.stdout = None
        return 0

    if args.estimate:
        return print_estimate(parser, catalog, tables, rows, args.estimate)

    from featcal_experiments.reproduce.render import build_table, markdown, write_tables
    from featcal_experiments.reproduce.runner import Runner, collect

    started = time.perf_counter()
    status = 0
    if not args.render_only:
        summary = Runner(catalog).run(rows)
        print(summary.text(), flush=True)
        status = 0 if summary.ok else 1
    models = []
    for table in tables:
        results, stale = collect(catalog, catalog.rows(table))
        models.append(build_table(catalog, table, results, stale))
    written = write_tables(models, catalog.runs_dir / "tables")
    for model in models:
        print(markdown(model))
    print("wrote " + ", ".join(str(p) for p in written))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return status


def print_estimate(parser, catalog, tables, rows, path: Path) -> int:
    import json

    from featcal_experiments.reproduce import estimate

    try:
        bench = json.loads(path.read_text())
        components = estimate.by_setting(bench)
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--estimate {path}: not a experiments/scripts/bench_rows.py result ({error})")
    print(f"estimated from {path} ({bench.get('machine')}, {bench.get('date')}; {bench.get('command')})")
    for table in tables:
        chosen = [r for r in rows if r.table == table and r.runs]
        settings = {r.setting for r in chosen}
        tasks = {key: catalog.tasks(key)[0] for key in settings}
        result = estimate.table_estimate(chosen, components, tasks, catalog.dependencies)
        missing = ", ".join(result["missing_settings"])
        if not result["run_seconds"]:
            print(f"table {table}: not estimated (no components for {missing})")
            continue
        total = f"{estimate.format_hours(result['total_seconds'])} over {len(result['run_seconds'])} runs"
        print(f"table {table}: " + (f"incomplete: {total} of the measured settings; no components for {missing}"
                                    if missing else total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
