"""Side-by-side tables from FusionBench program reports, and the header and files every checked-in result carries."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import date
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


def _accuracies(section: Dict) -> Dict[str, float]:
    return {k: v["accuracy"] for k, v in section.items() if isinstance(v, dict) and "accuracy" in v}


def _accuracy_columns(sections: Dict[str, Dict]):
    """model -> task -> accuracy, and the tasks in the first model's order with the average last; every model must
    have every task."""
    columns = {name: _accuracies(section) for name, section in sections.items()}
    first = next(iter(columns.values()))
    tasks = [t for t in first if t != "average"] + ["average"]
    for name, values in columns.items():
        missing = [t for t in tasks if t not in values]
        if missing:
            raise KeyError(f"{name} has no accuracy for {missing}")
    return columns, tasks


def _require_sections(report: Dict, models: Sequence[str], which: str = "the report") -> None:
    missing = [m for m in models if m not in report]
    if missing:
        raise KeyError(f"{which} has no {missing}; run FeatCal with method.return_upstream=true")


def comparison_table(report: Dict, models: List[str] = ("upstream", "featcal")) -> str:
    """Per-task and average accuracy (%) of several models evaluated in one FusionBench run."""
    _require_sections(report, models)
    columns, tasks = _accuracy_columns({m: report[m] for m in models})
    header = f"| task | {' | '.join(models)} | gain |"
    lines = [header, "|" + "---|" * (len(models) + 2)]
    for task in tasks:
        values = [100 * columns[m][task] for m in models]
        lines.append(f"| {task} | {' | '.join(f'{v:.1f}' for v in values)} | {values[-1] - values[0]:+.1f} |")
    return "\n".join(lines)


def method_rows_table(rows: Sequence[Tuple[str, Dict]]) -> str:
    """One row per model (label, FusionBench evaluation section), per-task and average accuracy (%) as columns."""
    columns, tasks = _accuracy_columns(dict(rows))
    lines = [f"| model | {' | '.join(tasks)} |", "|" + "---|" * (len(tasks) + 1)]
    for label, values in columns.items():
        lines.append(f"| {label} | {' | '.join(f'{100 * values[t]:.1f}' for t in tasks)} |")
    return "\n".join(lines)


def portable(text: str) -> str:
    """``text`` with the working folder's absolute path written relative to it and the home folder as ``~``, so that a
    checked-in result names no machine's folders."""
    cwd, home = str(Path.cwd().resolve()), str(Path.home())
    text = "." if text == cwd else text.replace(cwd + os.sep, "")
    if len(home) <= 1:
        return text
    return "~" if text == home else text.replace(home + os.sep, "~" + os.sep)


def result_header(script: str, argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """What every checked-in result names: the command that produced it (``argv`` as given, else the process's;
    its paths made portable), the machine and the date."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "command": shlex.join(["python", script, *map(portable, args)]),
        "machine": machine_line(),
        "date": date.today().isoformat(),
    }


def machine_line() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"


def write_results(out: Path, results: Dict, markdown: str) -> None:
    """``out``.json and ``out``.md side by side; the Markdown is also printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2, 3):
        print("usage: python -m featcal_fusionbench.integration.reporting PROGRAM_REPORT_JSON [SURGERY_PROGRAM_REPORT_JSON "
              "[AUTO_SELECT_PROGRAM_REPORT_JSON]]\n"
              "  one report (FeatCal with method.return_upstream=true): upstream and FeatCal side by side;\n"
              "  and a second one (a Surgery run on the same pools): TA, TA + FeatCal and TA + Surgery as rows;\n"
              "  and a third one (FeatCal with method.auto_select): its row after TA + FeatCal",
              file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    seconds = report.get("featcal_calibration", {}).get("seconds")
    if len(argv) == 1:
        print(comparison_table(report))
        if seconds is not None:
            print(f"\nFeatCal calibration time: {seconds:.2f} s")
        return 0
    _require_sections(report, ("upstream", "featcal"), "the first report")
    surgery = _model_section(json.loads(Path(argv[1]).read_text()), "surgery")
    rows = [("TA", report["upstream"]), ("TA + FeatCal", report["featcal"])]
    times = [] if seconds is None else [f"FeatCal {seconds:.1f} s"]
    if len(argv) == 3:
        auto = json.loads(Path(argv[2]).read_text())
        rows.append(("TA + FeatCal, label-free (auto_select)", _model_section(auto, "featcal")))
        auto_seconds = auto.get("featcal_calibration", {}).get("seconds")
        if auto_seconds is not None:
            times.append(f"FeatCal with auto_select {auto_seconds:.1f} s")
    rows.append(("TA + Surgery", surgery))
    print(method_rows_table(rows))
    surgery_log = Path(argv[1]).parent / "surgery_report.json"
    if surgery_log.is_file():
        times.append(f"Surgery {json.loads(surgery_log.read_text())['seconds']:.1f} s")
    if times:
        print(f"\ncalibration time: {', '.join(times)}")
    return 0


def _model_section(report: Dict, name: str) -> Dict:
    """The evaluated model's section: under ``name`` when the run also evaluated its upstream, else the report."""
    return report.get(name, report)


if __name__ == "__main__":
    sys.exit(main())
