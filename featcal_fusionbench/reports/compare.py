"""Runs side by side: each run's models (the upstream where the run evaluated it, and the method's) as rows of one
table with the per-task scores, and the runs' mean drift per block on one picture."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .drift import chosen_values, drift_series
from .drift import upstream_name as drift_upstream_name
from .runs import Run, model_sections, points_scale, read_run, section_scores

NAMES = {"featcal": "FeatCal", "surgery": "Surgery", "probsurgery": "ProbSurgery"}


def upstream_name(run: Run) -> str:
    return drift_upstream_name(run.method_report)


def method_label(run: Run) -> str:
    name = NAMES.get(run.method or "", run.method or "model")
    if chosen_values(run.method_report):
        name += ", label-free (auto_select)"
    return name


def rows(runs: Sequence[Run]) -> List[Tuple[str, Dict[str, float]]]:
    """(label, scores) per model; an upstream shown once when the runs evaluated the same one alike."""
    out: List[Tuple[str, Dict[str, float]]] = []
    for run in runs:
        sections = model_sections(run.program_report or {})
        upstream = upstream_name(run)
        for name, section in sections.items():
            scores = section_scores(section)
            if name == "upstream":
                label = upstream
            elif run.method and run.method_report.get("upstream") is not None:
                label = f"{upstream} + {method_label(run)}"
            else:
                label = method_label(run)
            if (label, scores) in out:
                continue
            if any(label == existing for existing, _ in out):
                label = f"{label} ({run.folder.name})"
            out.append((label, scores))
    return out


def markdown(runs: Sequence[Run]) -> str:
    table = rows(runs)
    tasks = [t for t in table[0][1] if t != "average"] + ["average"]
    scale = points_scale(s for _, s in table)
    lines = ["| model | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for label, scores in table:
        cells = ["" if scores.get(t) is None else f"{scores[t] * scale:.1f}" for t in tasks]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    times = [f"{method_label(r)} {r.seconds:.1f} s" for r in runs if r.seconds is not None]
    if times:
        lines.append(f"\ncalibration time: {', '.join(times)}")
    return "\n".join(lines)


def drift_figure(runs: Sequence[Run]):
    """Mean drift over tasks per block: each FeatCal run calibrated, and its reference (upstream) once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 4))
    shown_reference = set()
    for run in runs:
        if not run.method_report.get("blocks"):
            continue
        reference, series = drift_series(run.method_report)
        for label, per_task in series.items():
            if not per_task:
                continue
            mean = [sum(v) / len(v) for v in zip(*per_task.values())]
            if label != "calibrated":
                key = (label, tuple(round(m, 6) for m in mean))
                if key in shown_reference:
                    continue
                shown_reference.add(key)
                ax.plot(range(len(mean)), mean, linestyle="--", color="gray", label=f"{upstream_name(run)} ({label})")
            else:
                ax.plot(range(len(mean)), mean, marker="o", markersize=3, label=f"{upstream_name(run)} + {method_label(run)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("block")
    ax.set_ylabel("mean feature drift to the experts (L2)")
    if ax.lines:
        ax.legend(fontsize=7)
    ax.set_title("drift per block")
    fig.tight_layout()
    return fig


def compare(paths: Sequence[Path], out: Optional[Path] = None) -> Tuple[str, Optional[Path]]:
    """The table, and the drift picture's path (None when no run recorded drift)."""
    runs = [read_run(Path(p).parent if Path(p).is_file() else Path(p)) for p in paths]
    for run in runs:
        if run.problem is not None:
            raise ValueError(f"{run.folder}: {run.problem}")
    text = markdown(runs)
    picture = None
    if any(r.method_report.get("blocks") for r in runs):
        import matplotlib.pyplot as plt

        out = Path(out) if out is not None else _common_parent([r.folder for r in runs])
        out.mkdir(parents=True, exist_ok=True)
        picture = out / "compare_drift.png"
        fig = drift_figure(runs)
        fig.savefig(picture, dpi=80)
        plt.close(fig)
    return text, picture


def _common_parent(folders: Sequence[Path]) -> Path:
    parts = [f.resolve().parts for f in folders]
    common = [p[0] for p in zip(*parts) if len(set(p)) == 1]
    return Path(*common) if common else Path.cwd()


__all__ = ["compare", "drift_figure", "markdown", "method_label", "rows", "upstream_name"]
