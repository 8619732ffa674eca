"""Seeded choices of examples: the calibration examples of each task, their fit / held-out split and their folds."""

from __future__ import annotations

import zlib
from typing import List, Sequence, Tuple

import numpy as np
from torch.utils.data import Subset


def calibration_indices(num_available: int, num_examples: int, seed: int, task: str) -> List[int]:
    """``num_examples`` distinct indices, fixed by (seed, task name) alone.

    Keying on the task name rather than its position keeps a task's examples the
    same when the pool gains or loses other tasks.
    """
    rng = np.random.default_rng([seed, zlib.crc32(task.encode("utf-8"))])
    return sorted(rng.choice(num_available, size=num_examples, replace=False).tolist())


def subset(dataset, indices: Sequence[int]):
    """The examples of ``dataset`` at ``indices``, lazily."""
    if hasattr(dataset, "select"):  # datasets.Dataset: keeps lazy decoding
        return dataset.select(indices)
    return Subset(dataset, list(indices))



def heldout_split(num_examples: int, fraction: float, seed: int, task: str) -> Tuple[List[int], List[int]]:
    """(fit, held-out) positions in a task's calibration set: disjoint, covering it, both non-empty, fixed by
    (seed, task name) alone, like the calibration examples themselves (``calibration_indices``)."""
    heldout = int(round(fraction * num_examples))
    if heldout < 1 or heldout > num_examples - 1:
        raise ValueError(
            f"task {task!r}: {num_examples} calibration example(s) cannot be split into a fit and a held-out part "
            f"with heldout_fraction={fraction} (each needs at least one); raise num_calibration_examples"
        )
    # A stream distinct from the calibration examples' own (the extra word), so the split is not their order.
    rng = np.random.default_rng([seed, zlib.crc32(task.encode("utf-8")), zlib.crc32(b"heldout")])
    held = sorted(rng.choice(num_examples, size=heldout, replace=False).tolist())
    chosen = set(held)
    return [i for i in range(num_examples) if i not in chosen], held


def check_split_sizes(num_examples: int, world_size: int, fraction: float, tasks: Sequence[str]) -> None:
    """Fail before any model work when the split would leave a part empty (or a rank without examples)."""
    for task in tasks:
        fit, held = heldout_split(num_examples, fraction, 0, task)
        if min(len(fit), len(held)) < world_size:
            raise ValueError(
                f"task {task!r}: the fit ({len(fit)}) and held-out ({len(held)}) parts need at least one example "
                f"per rank ({world_size}); raise num_calibration_examples"
            )


def fold_of(num_examples: int, folds: int, seed: int, task: str) -> List[int]:
    """The fold (0 .. folds - 1) of each position in a task's calibration set: as equal in size as can be, fixed
    by (seed, task name) alone."""
    if folds < 2 or num_examples < folds:
        raise ValueError(f"task {task!r}: {num_examples} calibration example(s) cannot be split into {folds} folds "
                         f"(each needs at least one); raise num_calibration_examples or lower auto_select.folds")
    rng = np.random.default_rng([seed, zlib.crc32(task.encode("utf-8")), zlib.crc32(b"folds")])
    out = [0] * num_examples
    for rank, position in enumerate(rng.permutation(num_examples).tolist()):
        out[position] = rank % folds
    return out


def check_fold_sizes(num_examples: int, world_size: int, folds: int, tasks: Sequence[str]) -> None:
    """Fail before any model work when the folds are too small to give every device a part of each."""
    for task in tasks:
        smallest = num_examples // folds  # fold_of's folds differ in size by one at most
        if folds < 2 or smallest < max(world_size, 1):
            raise ValueError(
                f"task {task!r}: {num_examples} calibration example(s) in {folds} folds leave a fold of "
                f"{smallest}, fewer than one per device ({world_size}); raise num_calibration_examples or lower "
                f"auto_select.folds")
