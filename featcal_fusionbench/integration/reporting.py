"""The header and files every checked-in result carries (tables of runs: ``featcal_fusionbench.reports``)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import date
from pathlib import Path
from typing import Dict, Optional, Sequence


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
