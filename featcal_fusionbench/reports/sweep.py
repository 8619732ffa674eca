"""A sweep at a glance: one row per run sorted by the average score, the swept values read from each run's own
Hydra files, written as a markdown table (printed), ``sweep.csv`` and ``sweep.png``."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .runs import Run, points_scale, read_runs

BEST_MARK = "← best"


class NoRunsError(FileNotFoundError):
    """The folder holds no run."""


def swept_keys(runs: Sequence[Run]) -> List[str]:
    """The overridden keys whose values differ between runs (as typed on the command line: a config group's choice,
    ``method=featcal``, is one value however its config resolves), the one with the most distinct values first."""
    order: Dict[str, int] = {}
    for run in runs:
        for key in run.overrides:
            order.setdefault(key, len(order))
    distinct = {k: len({r.overrides.get(k) for r in runs}) for k in order}
    return sorted((k for k in order if distinct[k] > 1), key=lambda k: (-distinct[k], order[k]))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class Sweep:
    def __init__(self, root: Path):
        self.root = Path(root)
        runs = list(read_runs(self.root))
        if not runs:
            raise NoRunsError(f"{self.root}: no runs here (a run is a folder with Hydra's overrides.yaml or a "
                              "program_report.json)")
        self.keys = swept_keys(runs)
        self.scored = sorted((r for r in runs if r.problem is None), key=lambda r: -r.scores["average"])
        self.failed = [r for r in runs if r.problem is not None]
        self.tasks = [t for t in (self.scored[0].scores if self.scored else {}) if t != "average"]
        self.scale = points_scale(r.scores for r in self.scored)

    def name(self, run: Run) -> str:
        return str(run.folder.relative_to(self.root)) if run.folder != self.root else "."

    def score(self, run: Run, task: str) -> Optional[float]:
        value = run.scores.get(task)
        return None if value is None else value * self.scale

    # ---- the table ------------------------------------------------------------------------------------------

    def markdown(self) -> str:
        header = ["run", *self.keys, "average", *self.tasks, "calibration (s)", ""]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for i, run in enumerate(self.scored):
            cells = [self.name(run), *(_fmt(run.value(k)) for k in self.keys),
                     f"{self.score(run, 'average'):.2f}",
                     *(("" if self.score(run, t) is None else f"{self.score(run, t):.2f}") for t in self.tasks),
                     "" if run.seconds is None else f"{run.seconds:.1f}", BEST_MARK if i == 0 else ""]
            lines.append("| " + " | ".join(cells) + " |")
        for run in self.failed:
            cells = [self.name(run), *(_fmt(run.value(k)) for k in self.keys), "failed", *[""] * len(self.tasks),
                     "", run.problem]
            lines.append("| " + " | ".join(cells) + " |")
        unit = "points (%)" if self.scale == 100.0 else "as reported"
        return "\n".join(lines) + f"\n\n{len(self.scored)} runs scored, {len(self.failed)} failed; scores in {unit}."

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["run", "status", *self.keys, "average", *self.tasks, "calibration_seconds"])
            for run in self.scored:
                writer.writerow([self.name(run), "ok", *(run.value(k) for k in self.keys), self.score(run, "average"),
                                 *(self.score(run, t) for t in self.tasks), run.seconds])
            for run in self.failed:
                writer.writerow([self.name(run), f"failed: {run.problem}", *(run.value(k) for k in self.keys),
                                 *[""] * (len(self.tasks) + 2)])

    # ---- the picture ----------------------------------------------------------------------------------------

    def figure(self):
        """matplotlib's Figure: a heatmap of the average over the two most varied swept values (one panel per
        value of a third; a line plot for one), the best marked, then the same per task where there are several."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = self.keys[:3]
        targets = ["average"] + (self.tasks if len(self.tasks) > 1 and len(keys) <= 2 else [])
        facets = _values(self.scored, keys[2]) if len(keys) == 3 else [None]
        panels = [(t, f) for t in targets for f in facets]
        columns = min(len(panels), 3)
        rows = math.ceil(len(panels) / columns)
        fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.8 * rows), squeeze=False)
        for ax, (target, facet) in zip(axes.flat, panels):
            runs = [r for r in self.scored if facet is None or r.value(keys[2]) == facet]
            title = target if facet is None else f"{target}, {keys[2]} = {_fmt(facet)}"
            if len(keys) >= 2:
                self._heatmap(ax, runs, keys[0], keys[1], target, title)
            else:
                self._line(ax, runs, keys[0] if keys else None, target, title)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        rest = f"; other swept values: best of {', '.join(self.keys[3:])}" if len(self.keys) > 3 else ""
        fig.suptitle(f"{self.root.name}: {len(self.scored)} runs ({len(self.failed)} failed){rest}", fontsize=10)
        fig.tight_layout()
        return fig

    def _cell(self, runs: Sequence[Run], target: str) -> Optional[float]:
        values = [self.score(r, target) for r in runs]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    def _heatmap(self, ax, runs, row_key, column_key, target, title) -> None:
        import numpy as np
        from matplotlib.patches import Rectangle

        rows, columns = _values(runs, row_key), _values(runs, column_key)
        grid = np.full((len(rows), len(columns)), np.nan)
        for i, r in enumerate(rows):
            for j, c in enumerate(columns):
                value = self._cell([x for x in runs if x.value(row_key) == r and x.value(column_key) == c], target)
                if value is not None:
                    grid[i, j] = value
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.figure.colorbar(image, ax=ax, fraction=0.046)
        ax.set_xticks(range(len(columns)), [_fmt(c) for c in columns])
        ax.set_yticks(range(len(rows)), [_fmt(r) for r in rows])
        ax.set_xlabel(column_key)
        ax.set_ylabel(row_key)
        for (i, j), value in np.ndenumerate(grid):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="w", fontsize=8)
        if not np.isnan(grid).all():
            i, j = np.unravel_index(np.nanargmax(grid), grid.shape)
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5, label="best"))
        ax.set_title(title)

    def _line(self, ax, runs, key, target, title) -> None:
        xs = _values(runs, key) if key else list(range(len(runs)))
        ys = [self._cell([r for r in runs if (r.value(key) if key else i) == x], target)
              for i, x in enumerate(xs)]
        points = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        if points:
            best = max(points, key=lambda p: p[1])
            ax.plot([best[0]], [best[1]], marker="*", markersize=14, color="red", linestyle="none", label="best")
        numeric = [x for x in xs if isinstance(x, (int, float))]
        if numeric and len(numeric) == len(xs) and min(numeric) > 0 and max(numeric) / min(numeric) >= 100:
            ax.set_xscale("log")
        ax.set_xlabel(key or "run")
        ax.set_ylabel(target)
        ax.set_title(title)

    def write(self, folder: Optional[Path] = None) -> Tuple[Path, Optional[Path]]:
        """sweep.csv, and sweep.png where some run has scores to draw (None otherwise)."""
        import matplotlib.pyplot as plt

        folder = Path(folder or self.root)
        folder.mkdir(parents=True, exist_ok=True)
        self.write_csv(folder / "sweep.csv")
        if not self.scored:
            return folder / "sweep.csv", None
        fig = self.figure()
        fig.savefig(folder / "sweep.png", dpi=80)
        plt.close(fig)
        return folder / "sweep.csv", folder / "sweep.png"


def _values(runs: Sequence[Run], key: str) -> List[Any]:
    """The distinct values of ``key`` among ``runs``, sorted where they compare (numbers), else as first seen."""
    seen = list(dict.fromkeys(r.value(key) for r in runs))
    try:
        return sorted(seen)
    except TypeError:
        return seen


__all__ = ["BEST_MARK", "NoRunsError", "Sweep", "swept_keys"]
