"""A run's feature drift per block, drawn from its ``featcal_report.json``: for each task, the L2 distance of the
calibrated model's features to the expert's after each block, beside the upstream model's own trajectory where the
run tracked it (``method.track_upstream_drift=true``), else beside the block's drift before it was calibrated (the
same calibrated prefix, the upstream's block). Runs with a per-block choice (``auto_select``) get a second panel with
the lambda and rho chosen in each block, a block whose choice sat at an edge of its grid (after widening: lambda at
the numerical floor or the cap, rho at its bound) ringed, and one whose choice kept the method's values within the
noise marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

DRIFT_PICTURE = "featcal_drift.png"
PER_BLOCK = ("lambda_", "rho")


def drift_series(report: Dict[str, Any], metric: str = "l2") -> Tuple[str, Dict[str, Dict[str, List[float]]]]:
    """(the reference's label, {"calibrated" | reference: {task: one value per block}})."""
    blocks = report.get("blocks") or []
    tracked = any("upstream" in d for b in blocks for d in (b.get("drift") or {}).values())
    reference, key = ("upstream", "upstream") if tracked else ("uncalibrated block", "before")
    series: Dict[str, Dict[str, List[float]]] = {"calibrated": {}, reference: {}}
    for block in blocks:
        for task, drift in (block.get("drift") or {}).items():
            for label, which in (("calibrated", "after"), (reference, key)):
                value = (drift.get(which) or {}).get(metric)
                series[label].setdefault(task, []).append(float("nan") if value is None else float(value))
    return reference, series


def chosen_values(report: Dict[str, Any]) -> Dict[str, List[Optional[float]]]:
    """lambda / rho per block where the run chose them per block; empty otherwise."""
    blocks = report.get("blocks") or []
    if not any("hparams" in b for b in blocks):
        return {}
    return {k: [(b.get("hparams") or {}).get(k) for b in blocks] for k in PER_BLOCK}


def edge_blocks(report: Dict[str, Any]) -> Dict[str, List[int]]:
    """Per chosen value, the blocks whose choice sat at an edge of the searched grid; and ``kept``: the blocks that
    kept the method's values within the held-out noise."""
    out: Dict[str, List[int]] = {"lambda_": [], "rho": [], "kept": []}
    for b in report.get("blocks") or []:
        selection = b.get("selection") or {}
        for edge in selection.get("edge") or []:
            out["lambda_" if edge.startswith("lambda") else "rho"].append(b["block"])
        if selection.get("kept"):
            out["kept"].append(b["block"])
    return out


def upstream_name(report: Dict[str, Any]) -> str:
    """The upstream merger, short: FusionBench's class name without ``Algorithm`` (``TaskArithmetic``)."""
    source = str(report.get("upstream") or "upstream")
    return source.split(":")[-1].split(".")[-1].removesuffix("Algorithm") or "upstream"


def title(report: Dict[str, Any], method: str = "FeatCal") -> str:
    hp = report.get("hparams") or {}
    chosen = chosen_values(report)
    shown = [k for k in ("lambda_", "rho", "alpha") if k not in chosen and isinstance(hp.get(k), (int, float))]
    values = [f"{k.rstrip('_')} {hp[k]:g}" for k in shown]
    if chosen:
        values.insert(0, f"{' / '.join(k.rstrip('_') for k in chosen)} chosen per block (auto_select)")
    head = f"{method} after {upstream_name(report)}"
    return f"{head}: {', '.join(values)}" if values else head


def drift_figure(report: Dict[str, Any], method: str = "FeatCal"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    reference, series = drift_series(report)
    chosen = chosen_values(report)
    fig, axes = plt.subplots(1, 2 if chosen else 1, figsize=(11 if chosen else 6.5, 4), squeeze=False)
    ax = axes[0, 0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, task in enumerate(series["calibrated"]):
        color = colors[i % len(colors)]
        blocks = range(len(series["calibrated"][task]))
        ax.plot(blocks, series[reference][task], linestyle="--", color=color, label=f"{task}, {reference}")
        ax.plot(blocks, series["calibrated"][task], linestyle="-", marker="o", markersize=3, color=color,
                label=f"{task}, calibrated")
    values = [v for s in series.values() for line in s.values() for v in line if v == v and v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("block")
    ax.set_ylabel("feature drift to the expert (L2)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("drift per block")
    if chosen:
        ax2 = axes[0, 1]
        edges = edge_blocks(report)
        for name, line in chosen.items():
            values = [float("nan") if v is None else v for v in line]
            ax2.plot(range(len(line)), values, marker="o", label=name.rstrip("_"))
            at_edge = [i for i in edges[name] if i < len(values)]
            if at_edge:
                ax2.scatter(at_edge, [values[i] for i in at_edge], s=160, facecolors="none", edgecolors="red",
                            linewidths=1.5, zorder=3, label=f"{name.rstrip('_')} at a grid edge")
        kept = [i for i in edges["kept"] if i < len(chosen["lambda_"])]
        if kept:
            ax2.scatter(kept, [chosen["lambda_"][i] for i in kept], marker="s", s=90, facecolors="none",
                        edgecolors="gray", zorder=3, label="the method's values kept (within the noise)")
        ax2.set_yscale("log")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlabel("block")
        ax2.set_ylabel("chosen value")
        ax2.legend(fontsize=7)
        ax2.set_title("per-block choice (auto_select)")
    fig.suptitle(title(report, method), fontsize=10)
    fig.tight_layout()
    return fig


def write_drift_picture(report: Dict[str, Any], path: Path, method: str = "FeatCal") -> Path:
    import matplotlib.pyplot as plt

    fig = drift_figure(report, method)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


__all__ = ["DRIFT_PICTURE", "chosen_values", "drift_figure", "drift_series", "edge_blocks", "title", "upstream_name",
           "write_drift_picture"]
