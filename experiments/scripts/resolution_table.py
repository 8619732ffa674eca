"""The table of docs/featcal.md's "How finely the test labels rank" from the lab's resolution files (issue 61).

  python experiments/scripts/resolution_table.py experiments/results/autoselect/lab/resolution/*/*.json
  python experiments/scripts/resolution_table.py --among "lambda_=1e-06,0.0001 rho=2.0" <files>
  python experiments/scripts/resolution_table.py --reference "lambda_=1e-05 rho=2.0 alpha=0.6" <files>

Per build and n (each file's parent folder names its build), over the files' seeds: the oracle's lead over each
rule and over a labelled sweep on half the test labels (mean / worst), and the bootstrap bias of the oracle.
``--among``: also the oracle's lead over the best of the grid points with those values (e.g. criterion ``site``'s
default candidates), read from the files' per-example records. ``--reference``: a second table, per file, each
rule's lead over that grid point (e.g. the paper's values) and the bootstrap's standard error of the lead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def among_best(data, among) -> float:
    """The best score of ``data``'s grid points whose values are all in ``among`` (key -> allowed values)."""
    from featcal_experiments.label_resolution import averages, file_records

    points = [p for p in data["points"] if all(p[k] in values for k, values in among.items())]
    if not points:
        raise SystemExit(f"no grid point has {among}")
    grid, labels = file_records(data, points)
    return float(averages(grid, labels=labels).max())


def against_reference(data, reference, draws: int = 2000):
    """(rule, its lead over the grid point ``reference``, the bootstrap's standard error of that lead) per rule."""
    from featcal_experiments.label_resolution import file_records, paired

    point = [p for p in data["points"] if all(p[k] == v for k, v in reference.items())]
    if len(point) != 1:
        raise SystemExit(f"{len(point)} grid points have {reference}; --reference must name one")
    names = list(data["rules"])
    grid, labels = file_records(data, point + [data["rules"][name] for name in names])
    for i, name in enumerate(names, start=1):
        lead = paired({t: r[i] for t, r in grid.items()}, {t: r[0] for t, r in grid.items()}, draws, data["seed"],
                      labels)
        yield name, lead["difference"], lead["se"]


def rows(paths, among=None):
    groups = defaultdict(list)
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "summary" not in data:
            raise SystemExit(f"{path}: no summary yet (an interrupted run: its command resumes it)")
        groups[(Path(path).parent.name, data["n"])].append(data)
    for (build, n), files in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        files.sort(key=lambda d: d["seed"])
        lead = defaultdict(list)
        for d in files:
            s = d["summary"]
            for rule, score in s["rules"].items():
                lead[rule].append(s["oracle"] - score)
            lead["labelled half-test sweep"].append(s["oracle"] - s["split_half"]["sweep"]["mean"])
            if among:
                lead["best among " + " ".join(f"{k}={','.join(map(str, v))}" for k, v in among.items())].append(
                    s["oracle"] - among_best(d, among))
        yield build, n, [d["seed"] for d in files], lead, [d["summary"]["bias"] for d in files]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--among", default=None, help='grid values, e.g. "lambda_=1e-06,0.0001 rho=2.0"')
    parser.add_argument("--reference", default=None, help='one grid point, e.g. "lambda_=1e-05 rho=2.0 alpha=0.6"')
    args = parser.parse_args(argv)
    among = None
    if args.among:
        among = {k: [float(v) for v in values.split(",")] for k, values in (part.split("=") for part in args.among.split())}
    table = list(rows(args.files, among))
    names = list(dict.fromkeys(name for row in table for name in row[3]))  # a text world has no criterion site
    print("| build | n | seeds | " + " | ".join(f"oracle - {name}: mean / worst" for name in names)
          + " | the oracle's bias: mean |")
    print("|---|---:|---|" + "---:|" * (len(names) + 1))
    for build, n, seeds, lead, bias in table:
        cells = [f"{sum(v) / len(v):.2f} / {max(v):.2f}" if v else "-" for v in (lead.get(name) for name in names)]
        print(f"| {build} | {n} | {', '.join(map(str, seeds))} | " + " | ".join(cells)
              + f" | {sum(bias) / len(bias):.2f} |")
    if args.reference:
        reference = {k: float(v) for k, v in (part.split("=") for part in args.reference.split())}
        print(f"\n| build | n | seed | rule | rule - ({args.reference}) | the bootstrap's standard error |")
        print("|---|---:|---:|---|---:|---:|")
        for path in args.files:
            data = json.loads(Path(path).read_text())
            for name, lead, se in against_reference(data, reference):
                print(f"| {Path(path).parent.name} | {data['n']} | {data['seed']} | {name} | {lead:.2f} | {se:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
