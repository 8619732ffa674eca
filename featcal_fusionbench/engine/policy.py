"""Which lambda / rho / alpha a block is solved with: a policy the loop asks once per block.

For each block the loop asks its policy for a ``BlockChoice``, hands it every task's moments as they are collected
(``add_task``), then asks it for the block's solution (``solve``). ``FixedHParams`` solves with the method's values,
or with one set per block (a schedule); the label-free per-block selector (``autoselect.policy``) is a
``BlockSelection`` instead: it takes each part (fold) of each task's moments apart, scores each candidate solved on
all parts but one against the one left out, in turn, and names its choice, which the block is then solved with on
all batches.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence, Union

from ..core.block_sums import BlockSums
from ..core.hparams import FeatCalHParams
from .step import BlockSolution, BlockStep, TaskMoments

#: the hyperparameters a schedule or a selector sets per block
PER_BLOCK = ("lambda_", "rho", "alpha")


class BlockChoice(Protocol):
    """One block's hyperparameter choice. ``report`` holds what the block's report entry records of it."""

    report: Dict[str, Any]

    def add_task(self, step: BlockStep, moments: TaskMoments, expert_sites) -> None:
        """Take one task's moments."""

    def solve(self, step: BlockStep) -> BlockSolution:
        """The block's parameters to load, once every task was added (the base block is on the device)."""


class BlockSelection(Protocol):
    """One block's choice by cross-fitting: each part of each task's moments is added apart, then ``choose`` gives
    the values the block is solved with on all of the task's batches."""

    report: Dict[str, Any]

    def add(self, part: int, step: BlockStep, moments: TaskMoments, expert_sites) -> None:
        """Take one task's moments on its part ``part`` (0, 1, ...)."""

    def choose(self, step: BlockStep) -> FeatCalHParams:
        """The chosen values, once every task's parts were added (the base block is on the device)."""


class HParamPolicy(Protocol):
    #: whether each block is chosen over parts of the batches: ``for_block`` then gives a ``BlockSelection``
    needs_parts: bool

    def check(self, num_blocks: int) -> None:
        """Raise before any work when the policy cannot serve a model of ``num_blocks`` blocks."""

    def for_block(self, index: int, hparams: FeatCalHParams) -> Union[BlockChoice, BlockSelection]: ...


class FixedHParams:
    """The method's own values in every block, or ``schedule[index]`` in block ``index`` (recorded in the report)."""

    needs_parts = False

    def __init__(self, schedule: Optional[Sequence[FeatCalHParams]] = None):
        self.schedule = None if schedule is None else list(schedule)

    def check(self, num_blocks: int) -> None:
        if self.schedule is not None and len(self.schedule) != num_blocks:
            raise ValueError(f"a schedule of {len(self.schedule)} hyperparameter sets for {num_blocks} blocks")

    def for_block(self, index: int, hparams: FeatCalHParams) -> "FixedChoice":
        if self.schedule is None:
            return FixedChoice(hparams)
        hp = self.schedule[index]
        return FixedChoice(hp, {"hparams": {k: getattr(hp, k) for k in PER_BLOCK}})


class FixedChoice:
    """Folds each task's moments as soon as they arrive (memory does not grow with the number of tasks) and solves
    once, consuming the sums."""

    def __init__(self, hp: FeatCalHParams, report: Optional[Dict[str, Any]] = None):
        self.hp = hp
        self.report = report or {}
        self.sums: Optional[BlockSums] = BlockSums()

    def add_task(self, step: BlockStep, moments: TaskMoments, expert_sites) -> None:
        step.fold(moments, expert_sites, self.sums, self.hp)

    def solve(self, step: BlockStep) -> BlockSolution:
        sums, self.sums = self.sums, None
        return step.solve(sums, self.hp, consume=True)
