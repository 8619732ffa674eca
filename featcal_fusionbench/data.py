"""Seeded choice of the calibration examples: n per task from each task's train split."""

from __future__ import annotations

import zlib
from typing import Dict, List, Sequence

import numpy as np
from torch.utils.data import Subset


def calibration_indices(num_available: int, num_examples: int, seed: int, task: str) -> List[int]:
    """``num_examples`` distinct indices, fixed by (seed, task name) alone.

    Keying on the task name rather than its position keeps a task's examples the
    same when the pool gains or loses other tasks.
    """
    rng = np.random.default_rng([seed, zlib.crc32(task.encode("utf-8"))])
    return sorted(rng.choice(num_available, size=num_examples, replace=False).tolist())


def _subset(dataset, indices: Sequence[int]):
    if hasattr(dataset, "select"):  # datasets.Dataset: keeps lazy decoding
        return dataset.select(indices)
    return Subset(dataset, list(indices))


def check_train_splits(modelpool, tasks: Sequence[str]) -> None:
    """Every task needs a train split in the pool (labels are not used)."""
    available = list(modelpool.train_dataset_names)
    missing = [t for t in tasks if t not in available]
    if missing:
        raise ValueError(
            f"task(s) {missing} have no train split in the model pool; FeatCal draws its calibration "
            f"examples from `train_datasets` (the pool lists: {available or 'none'})"
        )


def select_calibration_data(modelpool, tasks: Sequence[str], num_examples: int, seed: int) -> Dict[str, object]:
    """Load each task's train split and keep exactly ``num_examples`` seeded examples."""
    check_train_splits(modelpool, tasks)
    selected = {}
    for task in tasks:
        dataset = modelpool.load_train_dataset(task)
        available = len(dataset)
        if available < num_examples:
            raise ValueError(
                f"task {task!r} has only {available} train examples, fewer than "
                f"num_calibration_examples={num_examples}"
            )
        selected[task] = _subset(dataset, calibration_indices(available, num_examples, seed, task))
    return selected
