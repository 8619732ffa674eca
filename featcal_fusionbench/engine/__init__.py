"""The forward-order calibration loop (paper Algorithm 1) and its parts.

``plan`` picks each block's sites; ``streams`` holds every task's hidden states between blocks; ``capture`` hooks a
block's module inputs; ``step`` is one block's work (collect a task's moments, fold, solve, write); ``policy`` says
which lambda / rho / alpha each block is solved with; ``loop`` walks the blocks in forward order.
"""

from .loop import FeatCalEngine
from .plan import BlockPlan, plan_blocks
from .policy import BlockChoice, FixedHParams, HParamPolicy
from .step import BlockSolution, BlockStep, TaskMoments, TaskStreams

__all__ = [
    "BlockChoice",
    "BlockPlan",
    "BlockSolution",
    "BlockStep",
    "FeatCalEngine",
    "FixedHParams",
    "HParamPolicy",
    "TaskMoments",
    "TaskStreams",
    "plan_blocks",
]
