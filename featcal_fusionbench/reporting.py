"""Side-by-side tables from FusionBench program reports, and the header and files every checked-in result carries."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import date
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def _accuracies(section: Dict) -> Dict[str, float]:
    return {k: v["accuracy"] for k, v in section.items() if isinstance(v, dict) and "accuracy" in v}


def comparison_table(report: Dict, models: List[str] = ("upstream", "featcal")) -> str:
    """Per-task and average accuracy (%) of several models evaluated in one FusionBench run."""
    missing = [m for m in models if m not in report]
    if missing:
        raise KeyError(f"the report has no {missing}; run FeatCal with method.return_upstream=true")
    columns = {m: _accuracies(report[m]) for m in models}
    tasks = [t for t in columns[models[0]] if t != "average"] + ["average"]
    header = f"| task | {' | '.join(models)} | gain |"
    lines = [header, "|" + "---|" * (len(models) + 2)]
    for task in tasks:
        values = [100 * columns[m][task] for m in models]
        lines.append(f"| {task} | {' | '.join(f'{v:.1f}' for v in values)} | {values[-1] - values[0]:+.1f} |")
    return "\n".join(lines)


def result_header(script: str, argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """What every checked-in result names: the command that produced it (``argv`` as given, else the process's),
    the machine and the date."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "command": shlex.join(["python", script, *args]),
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
    if len(argv) != 1:
        print("usage: python -m featcal_fusionbench.reporting PROGRAM_REPORT_JSON", file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    print(comparison_table(report))
    seconds = report.get("featcal_calibration", {}).get("seconds")
    if seconds is not None:
        print(f"\nFeatCal calibration time: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
