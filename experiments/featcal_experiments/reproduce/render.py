"""The paper's tables with our numbers: Markdown, LaTeX and CSV, each cell as paper / ours / diff (ours - paper).

Our numbers come from the runs' FusionBench reports (``result.json`` written by the runner): percentages of each
task's ``accuracy`` (CLIP, GLUE exact match) or ``spearman_rho`` (STS-B, regression tasks), and the report's
``average`` (the fine-tuned row: the mean of its per-task runs, once all are there). In the offline world the
columns are the world's tasks and the paper column is empty: its numbers are not comparable. The Markdown also lists
each row's wall time (the whole `fusion_bench` run, evaluation included, from ``result.json``) and a calibrator's own
time (``seconds`` of the ``<calibrator>_report.json`` it wrote into its run folder), since the paper's claim is about
both accuracy and cost. Table 12's cells are the mean and the standard deviation (ddof 1) over its seeds of each
budget's average accuracy, drawn as the paper's Fig. 3 too (``table_12.png``). The runs folder is printed relative to
the folder the tables are rendered from, or to the home folder, so that a checked-in table names no machine's paths.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from featcal_fusionbench.integration.reporting import portable

from .catalog import TABLES, Catalog, Row
from .paper import PAPER


METRICS = ("accuracy", "spearman_rho", "score")


def scores(report: dict, section: Optional[str] = None) -> Dict[str, float]:
    """Task (and ``average``) -> percentage, from a FusionBench report (or its ``section``, when it has one)."""
    if section and isinstance(report.get(section), dict):
        report = report[section]
    out = {}
    for key, entry in report.items():
        if isinstance(entry, dict):
            for metric in METRICS:
                value = entry.get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = 100.0 * float(value)
                    break
    return out


def row_scores(row: Row, results: Dict[str, dict]) -> Tuple[Dict[str, float], str]:
    """(column -> our percentage, status) of one row: "ok", "partial", "missing" or "not run: ..."."""
    if row.skip:
        return {}, f"not run: {row.skip}"
    if row.method == "finetuned":
        values = {}
        for run in row.runs:
            if run.id in results:
                got = scores(results[run.id]["report"])
                values.update({c: got[c] for c in run.provides if c in got})
        if not values:
            return {}, "missing"
        columns = [c for r in row.runs for c in r.provides]
        if len(values) == len(columns):
            values["average"] = statistics.fmean(values[c] for c in columns)
            return values, "ok"
        return values, "partial"
    run = row.runs[0]
    if run.id not in results:
        return {}, "missing"
    values = scores(results[run.id]["report"], run.calibrator)
    if "average" not in values:
        tasks = [k for k in values]
        if tasks:
            values["average"] = statistics.fmean(values[t] for t in tasks)
    return values, "ok"


@dataclass
class BudgetRuns:
    """A Table 12 row's runs so far, per budget column ``n<n>``: each seed's average, calibration seconds and peak
    RSS, and each task's scores."""
    averages: Dict[str, List[float]] = field(default_factory=dict)
    seconds: Dict[str, List[float]] = field(default_factory=dict)
    peak_rss: Dict[str, List[float]] = field(default_factory=dict)
    tasks: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)


def budget_scores(row: Row, results: Dict[str, dict], catalog: Catalog) -> BudgetRuns:
    out = BudgetRuns()
    for run in row.runs:
        if run.id not in results:
            continue
        column = f"n{run.budget[0]}"
        values = scores(results[run.id]["report"], run.calibrator)
        average = values.pop("average", statistics.fmean(values.values()) if values else None)
        if average is not None:
            out.averages.setdefault(column, []).append(average)
        for task, value in values.items():
            out.tasks.setdefault(column, {}).setdefault(task, []).append(value)
        report = calibrator_report(catalog, run)
        for key, target in (("seconds", out.seconds), ("peak_rss_bytes", out.peak_rss)):
            if isinstance(report.get(key), (int, float)):
                target.setdefault(column, []).append(float(report[key]))
    return out


def calibrator_report(catalog: Catalog, run) -> dict:
    """The ``<calibrator>_report.json`` a calibrator wrote into its run folder (the name every calibrator of this
    plugin saves its report under: FeatCal's REPORT_NAME, the baselines' report_name; experiments/tests/test_reproduce.py holds
    the two to each other); {} where there is none."""
    try:
        report = json.loads((catalog.run_dir(run.id) / f"{run.calibrator}_report.json").read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def calibrator_seconds(catalog: Catalog, run) -> Optional[float]:
    """The calibrator's own seconds, from its report (None where unknown)."""
    seconds = calibrator_report(catalog, run).get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else None


def row_times(row: Row, results: Dict[str, dict], catalog: Catalog) -> Tuple[Optional[float], Optional[float]]:
    """(wall seconds of the row's runs that have results, the calibrator's own seconds), None where unknown."""
    done = [results[run.id] for run in row.runs if run.id in results]
    wall = sum(float(r.get("seconds", 0.0)) for r in done) if done else None
    run = row.runs[0] if row.runs else None
    if run is None or not run.calibrator or run.id not in results:
        return wall, None
    return wall, calibrator_seconds(catalog, run)


@dataclass
class Cell:
    paper: Optional[float] = None
    ours: Optional[float] = None
    paper_std: Optional[float] = None  # Table 12: the standard deviation over seeds
    ours_std: Optional[float] = None
    seeds: int = 0  # Table 12: how many seeds' runs ``ours`` averages

    @property
    def diff(self) -> Optional[float]:
        if self.paper is None or self.ours is None:
            return None
        return self.ours - self.paper

    @property
    def shown_diff(self) -> Optional[float]:
        """ours as shown (one decimal) minus paper, so that the three printed numbers agree."""
        if self.paper is None or self.ours is None:
            return None
        return round(round(self.ours, 1) - self.paper, 1)


@dataclass
class RenderRow:
    id: str
    label: str
    method: str
    cells: Dict[str, Cell]
    status: str
    wall_seconds: Optional[float] = None
    calibration_seconds: Optional[float] = None
    budget_seconds: Dict[str, float] = field(default_factory=dict)  # Table 12: mean calibration seconds per n
    budget_peak_rss: Dict[str, float] = field(default_factory=dict)  # Table 12: mean peak RSS (bytes) per n
    budget_tasks: Dict[str, Dict[str, float]] = field(default_factory=dict)  # Table 12: n -> task -> mean score


@dataclass
class Block:
    title: str
    columns: List[Tuple[str, str]]  # (key, label)
    rows: List[RenderRow]


@dataclass
class TableModel:
    number: str
    caption: str
    world: str
    runs_dir: str
    blocks: List[Block]
    layout: str
    notes: List[str] = field(default_factory=list)
    has_paper: bool = True
    seeds: int = 0  # Table 12: seeds per budget


def build_table(catalog: Catalog, number: str, results: Dict[str, dict],
                stale: Optional[Dict[str, str]] = None) -> TableModel:
    spec = TABLES[number]
    # a table that is not the paper's (Table 12-llm) has its columns from the spec and no paper numbers
    paper = PAPER.get(number) or {
        "caption": spec.title, "rows": {}, "std": {}, "notes": [],
        "columns": [f"n{n}" for n in spec.budgets], "labels": {f"n{n}": f"n = {n}" for n in spec.budgets}}
    hub = catalog.world == "hub"
    rows = catalog.rows(number)
    model = TableModel(number, paper["caption"], catalog.world, portable(str(catalog.runs_dir)), [], spec.layout,
                       has_paper=hub and number in PAPER)
    if spec.layout == "budget":
        model.seeds = len(spec.seeds)
        group = spec.groups[0]
        key = group.hub if hub else group.offline
        columns = [(c, paper["labels"][c]) for c in paper["columns"]]
        block = Block(catalog.settings[key].title if key else f"{group.title} (not available: {group.hub_missing})",
                      columns, [])
        for row in rows:
            runs = budget_scores(row, results, catalog)
            averages = runs.averages
            mean_printed = paper["rows"].get(row.paper_key, {}) if hub and row.paper_key else {}
            std_printed = paper["std"].get(row.paper_key, {}) if hub and row.paper_key else {}
            cells = {}
            for c, _ in columns:
                values = averages.get(c, [])
                cells[c] = Cell(mean_printed.get(c), statistics.fmean(values) if values else None,
                                std_printed.get(c), statistics.stdev(values) if len(values) > 1 else None, len(values))
            done = sum(len(v) for v in averages.values())
            status = "ok" if done == len(row.runs) else "missing" if not done else "partial"
            wall = sum(float(results[r.id].get("seconds", 0.0)) for r in row.runs if r.id in results) or None
            block.rows.append(RenderRow(
                row.id, row.label, row.method, cells, status, wall, None,
                {c: statistics.fmean(v) for c, v in runs.seconds.items()},
                {c: statistics.fmean(v) for c, v in runs.peak_rss.items()},
                {c: {t: statistics.fmean(v) for t, v in by_task.items()} for c, by_task in runs.tasks.items()}))
        model.blocks.append(block)
        model.notes.append(f"seeds {', '.join(map(str, spec.seeds))}; each cell: mean +- standard deviation (ddof 1) "
                           "of the runs' average accuracy over the seeds with a result (a cell from fewer seeds "
                           "says how many)")
    elif spec.layout == "settings":
        columns = [(g.key, paper["labels"].get(g.key, g.key)) for g in spec.groups]
        by_method: Dict[str, RenderRow] = {}
        for row in rows:
            ours, status = row_scores(row, results)
            value = Cell(paper["rows"].get(row.paper_key, {}).get("average") if hub and row.paper_key else None,
                         ours.get("average"))
            entry = by_method.setdefault(row.method, RenderRow(row.method, row.label, row.method, {}, "ok"))
            entry.cells[row.group] = value
            if status != "ok":
                entry.status = status if entry.status == "ok" else entry.status
        model.blocks.append(Block("", columns, list(by_method.values())))
    else:
        for group in spec.groups:
            key = group.hub if hub else group.offline
            group_rows = [r for r in rows if r.group == group.key]
            if hub and number in PAPER:
                columns = [(c, paper["labels"].get(c, c)) for c in paper["columns"]]
            elif key is not None:
                tasks, _ = catalog.tasks(key)
                columns = [(t, t) for t in tasks] + [("average", "Avg.")]
            else:
                columns = [("average", "Avg.")]
            title = catalog.settings[key].title if key else f"{group.title} (not available: {group.offline_missing})"
            block = Block(title, columns, [])
            for row in group_rows:
                ours, status = row_scores(row, results)
                printed = paper["rows"].get(row.paper_key, {}) if hub and row.paper_key else {}
                cells = {c: Cell(printed.get(c), ours.get(c)) for c, _ in columns}
                block.rows.append(RenderRow(row.id, row.label, row.method, cells, status,
                                            *row_times(row, results, catalog)))
            model.blocks.append(block)
    for row in rows:
        if row.skip:
            model.notes.append(f"{row.id}: not run ({row.skip})")
    for run_id, why in (stale or {}).items():
        model.notes.append(f"{run_id}: not shown: {why}")
    if hub:
        model.notes.extend(f"paper print: {n}" for n in paper["notes"])
    return model


def _fmt(value: Optional[float], signed: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _status_mark(status: str) -> str:
    return {"ok": "", "missing": " (no result)", "partial": " (partial)"}.get(status, " (not run)")


def _with_std(value: Optional[float], std: Optional[float], seeds: int = 0, of: int = 0) -> str:
    text = _fmt(value)
    if text and std is not None:
        text += f" ± {std:.1f}"
    if text and seeds and seeds < of:
        text += f" ({seeds} seed{'s' if seeds > 1 else ''})"
    return text


def _lines(block: Block, row: RenderRow, has_paper: bool, seeds: int = 0):
    """(kind, values) lines of one row: paper, ours, diff (ours only offline). ``seeds``: Table 12's seeds per cell."""
    cols = [c for c, _ in block.columns]
    if has_paper:
        yield "paper", [_with_std(row.cells[c].paper, row.cells[c].paper_std) for c in cols]
    yield "ours", [_with_std(row.cells[c].ours, row.cells[c].ours_std, row.cells[c].seeds, seeds)
                   or ("n/a" if row.status.startswith("not run") else "–") for c in cols]
    if has_paper:
        yield "diff", [_fmt(row.cells[c].shown_diff, signed=True) for c in cols]


def markdown(model: TableModel) -> str:
    head = f"Table {model.number}" + (" on the offline worlds" if model.world == "offline" else "")
    out = [f"## {head}", "", f"Paper: {model.caption}", "",
           f"Runs: `{model.runs_dir}`. Cells: paper (as printed), ours, diff = ours - paper (points)."
           if model.has_paper else
           f"Runs: `{model.runs_dir}`. Offline world: the paper column is empty (another model and other tasks)."
           if model.world == "offline" else
           f"Runs: `{model.runs_dir}`. Not a table of the paper: the paper column is empty.", ""]
    for block in model.blocks:
        if block.title:
            out += [f"### {block.title}", ""]
        if model.layout == "tasks":
            out += ["| Method | paper | ours | diff |", "|---|---:|---:|---:|"]
            for row in block.rows:
                cell = row.cells.get("average", Cell())
                out.append(f"| {row.label}{_status_mark(row.status)} | {_fmt(cell.paper)} | {_fmt(cell.ours)} | "
                           f"{_fmt(cell.shown_diff, signed=True)} |")
            out += ["", "Per task:" if len(block.columns) > 1 else "", ""]
        out.append("| Method | | " + " | ".join(label for _, label in block.columns) + " |")
        out.append("|---|---|" + "---:|" * len(block.columns))
        for row in block.rows:
            for i, (kind, values) in enumerate(_lines(block, row, model.has_paper, model.seeds)):
                name = f"{row.label}{_status_mark(row.status)}" if i == 0 else ""
                out.append(f"| {name} | {kind} | " + " | ".join(values) + " |")
        out.append("")
        timed = [row for row in block.rows if row.wall_seconds is not None]
        if model.layout == "tasks" and timed:
            out += ["Times (seconds; run = the whole `fusion_bench` run with its evaluation, calibration = the "
                    "calibrator's own report):", "", "| Method | run (s) | calibration (s) |", "|---|---:|---:|"]
            out += [f"| {row.id} | {row.wall_seconds:.0f} | "
                    f"{'' if row.calibration_seconds is None else f'{row.calibration_seconds:.1f}'} |"
                    for row in timed]
            out.append("")
        if model.layout == "budget" and timed:
            out += ["Calibration seconds (the calibrator's own report, mean over seeds):", "",
                    "| Method | " + " | ".join(label for _, label in block.columns) + " |",
                    "|---|" + "---:|" * len(block.columns)]
            out += [f"| {row.label} | " + " | ".join(_fmt(row.budget_seconds.get(c)) for c, _ in block.columns)
                    + " |" for row in timed]
            out.append("")
        if model.layout == "budget" and any(row.budget_tasks for row in block.rows):
            out += budget_task_lines(block)
    if model.notes:
        out += ["Notes:", ""] + [f"- {n}" for n in model.notes] + [""]
    return "\n".join(out)


def budget_task_lines(block: Block) -> List[str]:
    """Each row at each budget: every task's score, the average (means over the seeds with a result), the
    calibrator's own seconds and the run's peak RSS (means too)."""
    tasks = list(dict.fromkeys(t for row in block.rows for by_task in row.budget_tasks.values() for t in by_task))
    out = ["Per task (mean over seeds; calibration seconds and the run's peak RSS from the calibrator's report):", "",
           "| Method | n | seeds | " + " | ".join(tasks) + " | Avg. | calibration (s) | peak RSS (GiB) |",
           "|---|---:|---:|" + "---:|" * (len(tasks) + 3)]
    for row in block.rows:
        for column, label in block.columns:
            by_task = row.budget_tasks.get(column)
            if not by_task:
                continue
            cell = row.cells[column]
            peak = row.budget_peak_rss.get(column)
            out.append(f"| {row.label} | {label.replace('n = ', '')} | {cell.seeds} | "
                       + " | ".join(_fmt(by_task.get(t)) for t in tasks)
                       + f" | {_fmt(cell.ours)} | {_fmt(row.budget_seconds.get(column))} | "
                       + ("" if peak is None else f"{peak / 2**30:.2f}") + " |")
    return out + [""]


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


def tex_text(text: str) -> str:
    """Escape text, keeping ``$...$`` math (the paper's captions) as it is."""
    parts = text.split("$")
    if len(parts) % 2 == 0:  # an unpaired $: all text
        return tex_escape(text)
    return "".join(f"${part}$" if i % 2 else tex_escape(part) for i, part in enumerate(parts)).replace("  ", " ")


def latex(model: TableModel) -> str:
    ncols = max(len(b.columns) for b in model.blocks)
    out = [f"% Table {model.number} ({model.world}); runs: {tex_escape(model.runs_dir)}",
           "% rows: paper (as printed), ours, $\\Delta$ = ours - paper" if model.has_paper else
           "% offline world: ours only (the paper's numbers are for other models and tasks)",
           r"\begin{table}[t]", r"\centering", r"\scriptsize",
           f"\\caption{{{tex_text(model.caption)}" + (" (offline world)" if model.world == "offline" else "") + "}",
           r"\begin{tabular}{ll" + "r" * ncols + "}", r"\toprule"]
    for b, block in enumerate(model.blocks):
        if b:
            out.append(r"\midrule")
        if block.title:
            out.append(f"\\multicolumn{{{ncols + 2}}}{{l}}{{\\textit{{{tex_escape(block.title)}}}}} \\\\")
        out.append("Method & & " + " & ".join(tex_escape(label) for _, label in block.columns) + r" \\")
        out.append(r"\midrule")
        for row in block.rows:
            for i, (kind, values) in enumerate(_lines(block, row, model.has_paper, model.seeds)):
                name = tex_escape(row.label + _status_mark(row.status)) if i == 0 else ""
                kind_tex = r"$\Delta$" if kind == "diff" else kind
                cells = (tex_escape(v).replace("–", "--").replace("±", r"$\pm$") for v in values)
                out.append(f"{name} & {kind_tex} & " + " & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(out)


CSV_FIELDS = ["table", "world", "block", "row", "method", "label", "column", "column_label", "paper", "ours", "diff",
              "status", "paper_std", "ours_std", "seeds"]


def csv_text(model: TableModel) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for block in model.blocks:
        for row in block.rows:
            for column, label in block.columns:
                cell = row.cells[column]
                writer.writerow({
                    "table": model.number, "world": model.world, "block": block.title, "row": row.id,
                    "method": row.method, "label": row.label, "column": column, "column_label": label,
                    "paper": "" if cell.paper is None else f"{cell.paper:.1f}",
                    "ours": "" if cell.ours is None else f"{cell.ours:.4f}",
                    "diff": "" if cell.diff is None else f"{cell.diff:+.4f}",
                    "status": row.status,
                    "paper_std": "" if cell.paper_std is None else f"{cell.paper_std:.1f}",
                    "ours_std": "" if cell.ours_std is None else f"{cell.ours_std:.4f}",
                    "seeds": cell.seeds or "",
                })
    return buffer.getvalue()


def plot_budget(model: TableModel, path: Path) -> None:
    """Table 12 as the paper's Fig. 3: each calibrator's mean accuracy against n, with its seeds' spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for block in model.blocks:
        for row in block.rows:
            for kind, style in (("ours", "-o"), ("paper", ":s")):
                points = [(int(c[1:]), getattr(row.cells[c], kind), getattr(row.cells[c], f"{kind}_std") or 0.0)
                          for c, _ in block.columns if getattr(row.cells[c], kind) is not None]
                if points:
                    ns, means, stds = zip(*points)
                    ax.errorbar(ns, means, yerr=stds, fmt=style, capsize=3, label=f"TA {row.label} ({kind})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration examples per task (n)")
    ax.set_ylabel("average accuracy (%)")
    ax.set_title(textwrap.fill(f"Table {model.number} ({model.world}): {model.blocks[0].title}", 80), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def write_tables(models: Sequence[TableModel], folder: Path) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for model in models:
        for suffix, text in (("md", markdown(model)), ("tex", latex(model)), ("csv", csv_text(model))):
            path = folder / f"table_{model.number}.{suffix}"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
            written.append(path)
        if model.layout == "budget":
            plot_budget(model, folder / f"table_{model.number}.png")
            written.append(folder / f"table_{model.number}.png")
    return written
