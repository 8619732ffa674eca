"""Runs read back from disk: a run is a folder that Hydra wrote a job's files into (``overrides.yaml``,
``config.yaml``, ``hydra.yaml``; directly, as FusionBench sets ``hydra.output_subdir: ""``, or under ``.hydra/``
where it is set), or any folder holding a FusionBench ``program_report.json``.

Scores come from the program report as FusionBench writes it (``fusion_bench/programs/fabric_fusion_program.py``
dumps the task pool's report): ``{task: {metric: value}, "average": {...}, "model_info": {...}}`` for one model,
or that per model name when a method returns several (``{"upstream": ..., "featcal": ...}``). A task's score is its
``score`` (our lm-eval pool), else ``accuracy`` (FusionBench's CLIP and text pools), else its only numeric value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import yaml

PROGRAM_REPORT = "program_report.json"
METHOD_REPORTS = {"featcal": "featcal_report.json", "surgery": "surgery_report.json",
                  "probsurgery": "probsurgery_report.json"}
_NOT_TASKS = {"model_info", "average"}
_SCORE_KEYS = ("score", "accuracy")


def _hydra_file(folder: Path, name: str) -> Optional[Path]:
    for candidate in (folder / name, folder / ".hydra" / name):
        if candidate.is_file():
            return candidate
    return None


def is_run(folder: Path) -> bool:
    return _hydra_file(folder, "overrides.yaml") is not None or (folder / PROGRAM_REPORT).is_file()


def find_runs(root: Path) -> List[Path]:
    """Every run folder at or under ``root``, in a natural order (a sweep's 0, 1, ..., 10)."""
    root = Path(root)
    found = [root] if is_run(root) else []
    found += [p for p in root.rglob("*") if p.is_dir() and p.name != ".hydra" and is_run(p)]
    return sorted(set(found), key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.relative_to(root).parts])


def task_score(entry: Any) -> Optional[float]:
    if not isinstance(entry, dict):
        return None
    for key in _SCORE_KEYS:
        if isinstance(entry.get(key), (int, float)):
            return float(entry[key])
    numbers = [v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return float(numbers[0]) if len(numbers) == 1 else None


def model_sections(report: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """model name -> its section of a program report (one model: the name ``model``). A method's summary beside its
    models (FeatCal's ``featcal_calibration``) is no model."""
    nested = {k: v for k, v in report.items() if isinstance(v, dict) and "average" in v}
    return nested if nested else {"model": report}


def section_scores(section: Dict[str, Any]) -> Dict[str, float]:
    """task -> score, and ``average`` (the report's, else the mean of the tasks')."""
    scores = {t: s for t, e in section.items()
              if t not in _NOT_TASKS and not t.endswith("_calibration") and (s := task_score(e)) is not None}
    average = task_score(section.get("average"))
    if average is None and scores:
        average = sum(scores.values()) / len(scores)
    if average is not None:
        scores["average"] = average
    return scores


def points_scale(scores: Iterable[Mapping[str, float]]) -> float:
    """100 where every score is a fraction (FusionBench's accuracies, lm-eval's metrics: shown as points), else 1."""
    return 100.0 if all(0.0 <= v <= 1.0 for s in scores for v in s.values()) else 1.0


@dataclass
class Run:
    folder: Path
    overrides: Dict[str, str] = field(default_factory=dict)  # key -> the value as typed
    config: Dict[str, Any] = field(default_factory=dict)
    method: Optional[str] = None  # featcal / surgery / probsurgery, from its report's file name
    method_report: Dict[str, Any] = field(default_factory=dict)
    program_report: Optional[Dict[str, Any]] = None
    problem: Optional[str] = None  # why the run has no scores

    @property
    def scores(self) -> Dict[str, float]:
        """The scores of the model the method produced (its own section when the run also evaluated the upstream)."""
        if self.program_report is None:
            return {}
        sections = model_sections(self.program_report)
        name = self.method if self.method in sections else next(iter(sections))
        return section_scores(sections[name])

    @property
    def seconds(self) -> Optional[float]:
        value = self.method_report.get("seconds")
        return float(value) if isinstance(value, (int, float)) else None

    def value(self, key: str) -> Any:
        """A swept key's value: typed from the job's config.yaml where it is there, else as typed."""
        node: Any = self.config
        for part in key.lstrip("+~").split("."):
            if not isinstance(node, dict) or part not in node:
                return _typed(self.overrides.get(key))
            node = node[part]
        return node


def _typed(text: Optional[str]) -> Any:
    if text is None:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_run(folder: Path) -> Run:
    run = Run(Path(folder))
    overrides = _hydra_file(run.folder, "overrides.yaml")
    if overrides is not None:
        for item in yaml.safe_load(overrides.read_text()) or []:
            key, _, value = str(item).partition("=")
            run.overrides[key.lstrip("+~")] = value
    config = _hydra_file(run.folder, "config.yaml")
    if config is not None:
        run.config = yaml.safe_load(config.read_text()) or {}
    for method, name in METHOD_REPORTS.items():
        if (run.folder / name).is_file():
            run.method, run.method_report = method, json.loads((run.folder / name).read_text())
            break
    report = run.folder / PROGRAM_REPORT
    if not report.is_file():
        run.problem = f"no {PROGRAM_REPORT} (the run failed or was stopped before its evaluation)"
    else:
        try:
            run.program_report = json.loads(report.read_text())
        except json.JSONDecodeError as error:
            run.problem = f"{PROGRAM_REPORT} unreadable: {error}"
        else:
            if not run.scores or any(not math.isfinite(v) for v in run.scores.values()):
                run.problem = f"{PROGRAM_REPORT} holds no task scores"
    return run


def read_runs(root: Path) -> Iterator[Run]:
    for folder in find_runs(root):
        yield read_run(folder)
