"""The paper's feature diagnostics on a CLIP pool: per-block drift (Fig. 1) and final-feature cosine (Fig. 2a).

One in-process run: Task Arithmetic merges once; FeatCal (tracking the upstream trajectory) and Surgery both
start from that same merged model; then every model's final image feature (projected, L2-normalised, after
Surgery's map for Surgery) is compared with the expert's on each task's test images.
"""

from __future__ import annotations

import copy
import json
import statistics
import textwrap
from pathlib import Path
from typing import Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from featcal_fusionbench.families import family_for


class FixedUpstream:
    """An upstream "merger" that hands out copies of one merged model, so every calibrator starts from it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def run(self, modelpool):
        return copy.deepcopy(self.model)


@torch.no_grad()
def final_feature_cosine(
    modelpool,
    models: Mapping[str, nn.Module],
    experts: Mapping[str, nn.Module],
    test_sets: Mapping[str, object],
    device,
    batch_size: int = 64,
) -> Dict[str, Dict[str, float]]:
    """model name -> task -> mean per-image cosine between the model's and the task expert's final feature.

    Features are read at the family's feature site (CLIP: the projected, normalised image embedding); a model
    with ``is_surgery_model`` has the task's map applied (as FusionBench's classifier applies it)."""
    family = family_for(next(iter(experts.values())))
    site = family.feature_site(modelpool, next(iter(experts.values()))).to(device)
    result: Dict[str, Dict[str, float]] = {name: {} for name in models}
    for task, dataset in test_sets.items():
        expert = experts[task].to(device).eval()
        sums = {name: 0.0 for name in models}
        count = 0
        for images in family.batches(modelpool, dataset, batch_size):
            images = images.to(device)
            reference = site.features(expert, images)
            for name, model in models.items():
                model.to(device).eval()
                if getattr(model, "is_surgery_model", False):
                    features = model.compute_surgery_features(site.features(model.model, images), task)[0]
                else:
                    features = site.features(model, images)
                sums[name] += float(F.cosine_similarity(features, reference, dim=-1).sum())
            count += len(images)
        expert.to("cpu")
        for name in models:
            result[name][task] = sums[name] / count
    for name in models:
        result[name]["average"] = statistics.fmean(v for k, v in result[name].items() if k != "average")
    return result


def block_drift(report: Mapping) -> Dict[str, Dict[str, list]]:
    """From a FeatCal report with upstream tracking: per task, per block, the L2 drift and cosine to the expert of
    the upstream model's own trajectory and of the calibrated model."""
    tasks = report["tasks"]
    out = {}
    for task in tasks:
        entries = [block["drift"][task] for block in report["blocks"]]
        if "upstream" not in entries[0]:
            raise ValueError("the FeatCal report has no upstream drift: run it with track_upstream_drift=true")
        out[task] = {
            f"{which}_{metric}": [e[which][metric] for e in entries]
            for which in ("upstream", "after")
            for metric in ("l2", "cosine")
        }
    return out


def _wrapped(title: str, width: int) -> str:
    """Titles carry the whole command that made the figure; wrapped, so that none of it is cut at the edges."""
    return "\n".join(textwrap.fill(line, width) for line in title.splitlines())


def plot_drift(drift: Mapping, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric, label in ((axes[0], "l2", "mean L2 distance to the expert"), (axes[1], "cosine", "mean cosine to the expert")):
        for which, colour, name in (("upstream", "tab:red", "Task Arithmetic"), ("after", "tab:blue", "+ FeatCal")):
            curves = [d[f"{which}_{metric}"] for d in drift.values()]
            blocks = range(1, len(curves[0]) + 1)
            for curve in curves:
                ax.plot(blocks, curve, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(blocks, [statistics.fmean(v) for v in zip(*curves)], color=colour, linewidth=2, label=f"{name} (mean)")
        ax.set_xlabel("block")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(_wrapped(title, 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_groups(values: Mapping[str, Mapping[str, float]], path: Path, ylabel: str, title: str,
                reference: Optional[float] = None) -> None:
    """Grouped bars: one group per inner key (e.g. corruption), one bar per outer key (e.g. calibrator)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(values)
    groups = list(next(iter(values.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(groups)), 3.8))
    for i, name in enumerate(names):
        ax.bar([g + i * width for g in range(len(groups))], [values[name][g] for g in groups], width, label=name)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label="upstream")
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups, rotation=30 if len(groups) > 5 else 0, ha="right" if len(groups) > 5 else "center")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(_wrapped(title, 75), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweeps(results: Mapping, path: Path, title: str) -> None:
    """One panel per factor: FeatCal's average accuracy against the factor, one line per upstream merger."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = list(next(iter(results["featcal"].values())))
    fig, axes = plt.subplots(1, len(factors), figsize=(4.2 * len(factors), 3.6), squeeze=False)
    axes = axes[0]
    for ax, factor in zip(axes, factors):
        for i, (upstream, per_factor) in enumerate(results["featcal"].items()):
            colour = f"C{i}"
            ax.plot(per_factor[factor]["values"], per_factor[factor]["accuracy"], "o-", color=colour, label=f"{upstream} + FeatCal")
            ax.axhline(results["upstream"][upstream], color=colour, linestyle="--", linewidth=1, label=f"{upstream}")
        if factor == "lambda_" and all(v > 0 for p in results["featcal"].values() for v in p[factor]["values"]):
            ax.set_xscale("log")
        ax.set_xlabel(factor.rstrip("_"))
        ax.set_ylabel("average accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    # about 13 characters per inch at this size: a one-panel figure (one factor) needs shorter lines
    fig.suptitle(_wrapped(title, min(110, int(13 * 4.2 * len(factors)))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_report(log_dir: Path, name: str) -> Optional[dict]:
    found = sorted(Path(log_dir).rglob(name))
    return json.loads(found[-1].read_text()) if found else None
