"""Seeded choice of the calibration examples: n per task from each task's train (or test) split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Optional, Sequence

from ..core.sampling import calibration_indices, subset

SPLITS = ("train", "test")


def check_splits(
    modelpool, tasks: Sequence[str], split: str = "train", calibration_datasets: Optional[Mapping] = None
) -> None:
    """Every task needs calibration examples: an entry of ``calibration_datasets``, else the pool's split."""
    if split not in SPLITS:
        raise ValueError(f"the calibration split must be one of {SPLITS}, got {split!r}")
    if calibration_datasets is not None and not isinstance(calibration_datasets, Mapping):
        raise TypeError(f"calibration_datasets must map task names to dataset configs, got {calibration_datasets!r}")
    available = list(getattr(modelpool, f"{split}_dataset_names"))
    missing = [t for t in tasks if t not in available and t not in (calibration_datasets or {})]
    if missing:
        raise ValueError(
            f"task(s) {missing} have no calibration examples: the model pool has no {split} split for them "
            f"(its `{split}_datasets` list: {available or 'none'}) and `calibration_datasets` has no entry "
            f"(it lists: {list(calibration_datasets or {}) or 'none'})"
        )


def load_calibration_dataset(modelpool, task: str, split: str, calibration_datasets: Optional[Mapping]):
    """``calibration_datasets[task]`` (a dataset config, instantiated) when given, else the pool's split."""
    if calibration_datasets is not None and task in calibration_datasets:
        from fusion_bench.utils import instantiate

        return instantiate(calibration_datasets[task])
    return getattr(modelpool, f"load_{split}_dataset")(task)


def calibration_source(task: str, split: str, calibration_datasets: Optional[Mapping]) -> str:
    """Where a task's calibration examples come from, for the reports."""
    if calibration_datasets is not None and task in calibration_datasets:
        config = calibration_datasets[task]
        target = config.get("_target_", type(config).__name__) if isinstance(config, Mapping) else type(config).__name__
        details = {k: v for k, v in config.items() if k in ("corruption", "severity", "name", "split")} if isinstance(config, Mapping) else {}
        return f"calibration_datasets: {target} {details}" if details else f"calibration_datasets: {target}"
    return f"the pool's {split} split"


def select_calibration_data(
    modelpool, tasks: Sequence[str], num_examples: int, seed: int, split: str = "train",
    calibration_datasets: Optional[Mapping] = None,
) -> Dict[str, object]:
    """Load each task's calibration examples and keep exactly ``num_examples`` seeded ones."""
    check_splits(modelpool, tasks, split, calibration_datasets)
    selected = {}
    for task in tasks:
        dataset = load_calibration_dataset(modelpool, task, split, calibration_datasets)
        available = len(dataset)
        if available < num_examples:
            raise ValueError(
                f"task {task!r} has only {available} {split} examples, fewer than "
                f"num_calibration_examples={num_examples}"
            )
        selected[task] = subset(dataset, calibration_indices(available, num_examples, seed, task))
    return selected


def shard(dataset, rank: int, world_size: int):
    """Rank ``rank``'s share of a calibration set: every ``world_size``-th example, disjoint across ranks."""
    if world_size == 1:
        return dataset
    if len(dataset) < world_size:
        raise ValueError(
            f"{len(dataset)} calibration examples cannot be shared by {world_size} ranks; "
            "use at least one example per rank"
        )
    return subset(dataset, list(range(rank, len(dataset), world_size)))
