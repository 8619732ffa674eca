"""Extract the paper's Tables 1, 2, 3, 4, App. I (Tables 7-11) and App. I's Table 12 (sample budget) into experiments/featcal_experiments/reproduce/paper.py.

Usage: python experiments/scripts/extract_paper_numbers.py [PAPER_MD] [--check]

Every cell is recorded as printed: the absolute value before any arrow, never a value recomputed from an arrow.
Row keys are ``<setting>/<method>`` (the runner's run identities, experiments/featcal_experiments/reproduce/catalog.py), column
keys are FusionBench's task names and ``average`` (Table 12: ``n<budget>``, with the printed standard deviations
under ``std``). Printed anomalies are kept as they are and listed in each table's
``notes``: blank cells inside a row (dropped; the remaining values are taken in column order), printed arrows
that disagree with value minus upstream value (arrows are not used otherwise), and a printed Avg. more than 0.15
from the mean of its row's printed cells. ``--check`` compares with the module
instead of writing it (exit status 1 on a difference).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PAPER = Path("/work/shared/paper/featcal-paper.md")
MODULE = REPO / "experiments" / "featcal_experiments" / "reproduce" / "paper.py"

LABELS = {
    "SUN397": "sun397", "Cars": "stanford-cars", "RESISC45": "resisc45", "EuroSAT": "eurosat", "SVHN": "svhn",
    "GTSRB": "gtsrb", "MNIST": "mnist", "DTD": "dtd", "Flowers": "oxford_flowers102", "PCAM": "pcam",
    "FER": "fer2013", "Pets": "oxford-iiit-pet", "STL10": "stl10", "C100": "cifar100", "C10": "cifar10",
    "Food": "food101", "F-MNIST": "fashion_mnist", "EMNIST": "emnist_letters", "KMNIST": "kmnist",
    "Rendered": "rendered-sst2", "Avg.": "average",
    "CoLA": "glue-cola", "MNLI": "glue-mnli", "MRPC": "glue-mrpc", "QNLI": "glue-qnli", "QQP": "glue-qqp",
    "RTE": "glue-rte", "SST-2": "glue-sst2", "STS-B": "glue-stsb",
    "8-Task L/14": "l14-8", "14-Task B/32": "b32-14", "14-Task L/14": "l14-14", "20-Task B/32": "b32-20",
    "20-Task L/14": "l14-20",
    # Table 4: the lm-eval task that stands for each column (config/taskpool/LMEvalHarnessTaskPool/mergebench_table4.yaml)
    "MATH-500": "math500_boxed", "GSM8K": "gsm8k_cot", "HumanEval+": "evalplus_humaneval_chat", "MBPP+": "evalplus_mbpp_chat",
    "IFEval": "ifeval", "ARC-C": "arc_challenge_chat_lines",
}
METHODS = {
    "Pre-trained": "pretrained", "Base": "pretrained", "Fine-tuned (STL)": "finetuned", "Traditional MTL": "mtl",
    "Simple Averaging": "simple_average", "Task Arithmetic": "ta", "AdaMerging": "adamerging", "WUDI-Merging": "wudi",
}
CALIBRATORS = {"w/ Surgery": "surgery", "w/ ProbSurgery": "probsurgery", "w/ FEATCAL": "featcal"}
# table number -> (caption prefix, setting of its rows; None: one setting per column (Table 2) or per block (Table 3))
TABLES = {
    "1": ("Table 1:", "b32-8"),
    "2": ("Table 2:", None),
    "3": ("Table 3:", None),
    "4": ("Table 4:", None),
    "7": ("Table 7:", "l14-8"),
    "8": ("Table 8:", "b32-14"),
    "9": ("Table 9:", "l14-14"),
    "10": ("Table 10:", "b32-20"),
    "11": ("Table 11:", "l14-20"),
}
T3_BLOCKS = {"Base": "t5-base", "Large": "t5-large"}
# Table 4's blocks in print order; each opens with its Base row, its model named on the Task Arithmetic row
T4_BLOCKS = (("Llama-3.2-3B-Instruct", "llama3.2-3b"), ("Llama-3.1-8B-Instruct", "llama3.1-8b"))
BUDGET_TABLE = "12"  # mean +- std over 3 seeds per calibration budget n, after Task Arithmetic on B/32 8 tasks
BUDGET_ROWS = {"TA w/ Surgery": "ta+surgery", "TA w/ ProbSurgery": "ta+probsurgery", "TA w/ FEATCAL": "ta+featcal"}
MEAN_STD = re.compile(r"(-?\d+(?:\.\d*)?)\s*\\pm\s*(\d+(?:\.\d*)?)")

NUMBER = re.compile(r"^\s*(?:<b>)?\s*(-?\d+(?:\.\d*)?)")
ARROW = re.compile(r"(?:<sup>\s*([↑↓])\s*([\d.]+)\s*</sup>|\$\\(uparrow|downarrow)_\{([\d.]+)\}\$|\(([+-][\d.]+)\))")


def parse_cell(cell: str):
    """(value, printed delta or None, delta text) of one printed cell."""
    match = NUMBER.match(cell)
    if not match:
        raise ValueError(f"no number in cell {cell!r}")
    value = float(match.group(1))
    arrow = ARROW.search(cell)
    if not arrow:
        return value, None, None
    if arrow.group(1):
        sign, text = (1 if arrow.group(1) == "↑" else -1), arrow.group(2)
    elif arrow.group(3):
        sign, text = (1 if arrow.group(3) == "uparrow" else -1), arrow.group(4)
    else:
        sign, text = 1, arrow.group(5)
    return value, sign * float(text.rstrip(".") or 0), text


def delta_agrees(value: float, base: float, printed: float, text: str) -> bool:
    """A printed delta like ``19.`` is truncated: compare its integer part only."""
    actual = value - base
    if text.lstrip("+-").endswith("."):
        return math.trunc(round(actual, 1)) == math.trunc(printed)
    return abs(actual - printed) <= 0.11


def table_lines(lines, caption):
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    block = []
    for line in lines[start + 1:]:
        if line.startswith(("Table ", "#", "Figure ", "Tab. ", "On B/32", "The best", "**", "---")):
            break
        block.append(line)
    return start, [b for b in block if b.strip()]


def extract_budget(lines) -> dict:
    """Table 12: one row per calibrator after Task Arithmetic, one column per n, cells ``$mean \\pm std$``."""
    start, block = table_lines(lines, f"Table {BUDGET_TABLE}:")
    header = [c.strip() for c in block[0].split("\t")[1:] if c.strip()]
    budgets = [int(re.search(r"n\s*=\s*(\d+)", h).group(1)) for h in header]
    columns = [f"n{n}" for n in budgets]
    rows, std = {}, {}
    for line in block[1:]:
        cells = line.split("\t")
        key = f"b32-8/{BUDGET_ROWS[cells[0].strip()]}"
        pairs = [MEAN_STD.search(c) for c in cells[1:] if c.strip()]
        if len(pairs) != len(columns) or not all(pairs):
            raise ValueError(f"Table {BUDGET_TABLE}, {cells[0].strip()}: expected {len(columns)} mean +- std cells: {line!r}")
        rows[key] = {c: float(m.group(1)) for c, m in zip(columns, pairs)}
        std[key] = {c: float(m.group(2)) for c, m in zip(columns, pairs)}
    return {
        "caption": lines[start].strip(),
        "columns": columns,
        "labels": {c: f"n = {n}" for c, n in zip(columns, budgets)},
        "rows": rows,
        "std": std,
        "notes": [],
    }


def extract(paper_text: str) -> dict:
    lines = paper_text.splitlines()
    out = {}
    for number, (caption, setting) in TABLES.items():
        start, block = table_lines(lines, caption)
        caption_text = lines[start].strip()
        notes = []
        if number == "3":
            header = [c.strip() for c in block[1].split("\t") if c.strip()]
            body = block[2:]
        elif number == "4":
            header = [c.strip() for c in block[0].split("\t")[2:] if c.strip()]
            body = block[1:]
        else:
            header = [c.strip() for c in block[0].split("\t")[1:] if c.strip()]
            body = block[1:]
        columns = [LABELS[h] for h in header if h != "GLUE Tasks"]
        if number == "3":
            columns.append("average")
        labels = {LABELS[h]: h for h in header if h in LABELS}
        if number == "3":  # its Avg. is printed on the first of its two header lines
            labels["average"] = "Avg."
        rows, upstream, block_setting, block_index = {}, None, None, -1
        for line in body:
            cells = line.split("\t")
            if number == "4":
                name, cells = cells[0].strip(), cells[1:]
                if cells[0].strip() == "Base":
                    block_index += 1
                    block_setting = T4_BLOCKS[block_index][1]
                if name and name != T4_BLOCKS[block_index][0]:
                    raise ValueError(f"Table 4: block {block_index + 1} names {name!r}, expected {T4_BLOCKS[block_index][0]!r}")
            if number == "3":
                if cells[0].strip() in T3_BLOCKS:
                    block_setting = T3_BLOCKS[cells[0].strip()]
                    cells = cells[1:]
                elif cells[0].strip() == "":
                    cells = cells[1:]
            label, values = cells[0].strip(), cells[1:]
            if label.startswith("<i>"):
                continue
            if label in METHODS:
                method = METHODS[label]
                if method not in ("pretrained", "finetuned", "mtl"):
                    upstream = method
            else:
                method = f"{upstream}+{CALIBRATORS[label]}"
            blanks = [i for i, v in enumerate(values) if not v.strip()]
            inner = [i for i in blanks if i < max((j for j, v in enumerate(values) if v.strip()), default=-1)]
            printed = [v for v in values if v.strip()]
            if len(printed) != len(columns):
                raise ValueError(f"Table {number}, {label}: {len(printed)} values for {len(columns)} columns: {line!r}")
            if inner:
                notes.append(f"{label} ({method}): a blank cell is printed inside the row (after column "
                             f"{inner[0]} of {len(columns)}); the {len(printed)} printed values are taken in column order")
            parsed = [parse_cell(v) for v in printed]
            if number == "2":
                for col, (value, _, _) in zip(columns, parsed):
                    rows[f"{col}/{method}"] = {"average": value}
            else:
                key = f"{block_setting or setting}/{method}"
                rows[key] = {col: value for col, (value, _, _) in zip(columns, parsed)}
                cells = [v for c, v in rows[key].items() if c != "average"]
                mean = sum(cells) / len(cells)
                if abs(mean - rows[key]["average"]) > 0.15:
                    notes.append(f"{label} ({method}): printed Avg. {rows[key]['average']} but its {len(cells)} "
                                 f"printed cells average {mean:.2f}")
            # arrows are not used; report the ones that disagree with value - upstream value
            for col, (value, delta, text) in zip(columns, parsed):
                if delta is None or method in ("pretrained", "finetuned", "mtl") or "+" not in method:
                    continue
                base_key = f"{col}/{upstream}" if number == "2" else f"{block_setting or setting}/{upstream}"
                base = rows[base_key]["average" if number == "2" else col]
                if not delta_agrees(value, base, delta, text):
                    notes.append(f"{label} ({method}), {labels.get(col, col)}: printed {value} with change {text!r} "
                                 f"({'+' if delta >= 0 else ''}{delta}) but the upstream row prints {base}")
        out[number] = {
            "caption": caption_text,
            "columns": columns,
            "labels": labels,
            "rows": rows,
            "notes": notes,
        }
    out[BUDGET_TABLE] = extract_budget(lines)
    return out


HEADER = '''"""The paper's numbers (FeatCal paper, Tables 1, 2, 3, 4, App. I Tables 7-11 and Table 12), as printed.

Generated by ``python experiments/scripts/extract_paper_numbers.py`` from the paper's Markdown; do not edit by hand.
``PAPER[table]["rows"]["<setting>/<method>"][column]``: percentages; columns are FusionBench task names (Table 4:
lm-eval task names) and ``average`` (Table 2: ``average`` only, one row key per setting; Table 12: ``n<budget>`` columns, with the printed
standard deviations over seeds under ``std``). ``notes`` lists what is odd in the print
(blank cells inside a row, arrows that disagree with the values); the values are kept as printed regardless.
"""

'''


def module_text(data: dict) -> str:
    """One line per printed row, so that a diff of the module reads like a diff of the paper's tables."""
    out = [HEADER, "PAPER = {\n"]
    for number, table in data.items():
        out.append(f"    {number!r}: {{\n")
        out.append(f"        'caption': {table['caption']!r},\n")
        out.append(f"        'columns': {table['columns']!r},\n")
        out.append(f"        'labels': {table['labels']!r},\n")
        out.append("        'rows': {\n")
        for key, cells in table["rows"].items():
            out.append(f"            {key!r}: {cells!r},\n")
        out.append("        },\n")
        if "std" in table:
            out.append("        'std': {\n")
            for key, cells in table["std"].items():
                out.append(f"            {key!r}: {cells!r},\n")
            out.append("        },\n")
        out.append("        'notes': [\n")
        for note in table["notes"]:
            out.append(f"            {note!r},\n")
        out.append("        ],\n")
        out.append("    },\n")
    out.append("}\n")
    return "".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", nargs="?", type=Path, default=DEFAULT_PAPER)
    parser.add_argument("--check", action="store_true", help="compare with the module instead of writing it")
    args = parser.parse_args(argv)
    data = extract(args.paper.read_text())
    text = module_text(data)
    if args.check:
        same = MODULE.is_file() and MODULE.read_text() == text
        print("up to date" if same else f"{MODULE} differs from the paper's tables")
        return 0 if same else 1
    MODULE.write_text(text)
    for number, table in data.items():
        print(f"Table {number}: {len(table['rows'])} rows x {len(table['columns'])} columns; {len(table['notes'])} notes")
        for note in table["notes"]:
            print(f"  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
