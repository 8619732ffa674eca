"""One block's omega-weighted sums over tasks: the right-hand sides of Eq. 16 (weights), 54 (biases) and 58
(norm affines), to which each task's moments are added as soon as the task is done."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Mapping, Protocol, Sequence

from torch import Tensor

from .moments import add_into
from .solver import SOLVE_DTYPE, task_weight


class TaskSums(Protocol):
    """Sums over tasks that one task's finalised moments are added to: the solve's (``BlockSums``) and the held-out
    objective's (``objective.HeldoutObjective``). ``group`` has the group's site ``names``; ``expert_sites`` maps a
    site name to the expert's site (its ``weight`` and ``bias``); ``hparams`` gives ``alpha`` and ``eps``."""

    num_tasks: int

    def nbytes(self) -> int: ...

    def add_linear(self, gi: int, group: Any, stats: Any, expert_sites: Mapping[str, Any], hparams: Any,
                   with_bias: bool = True) -> None: ...

    def add_norm(self, name: str, stats: Any, expert_site: Any) -> None: ...


class BlockSums:
    """omega-weighted sums over tasks for one block (the right-hand sides of Eq. 16, 54, 58); a ``TaskSums``."""

    def __init__(self):
        self.gram: Dict[int, Tensor] = {}
        self.omega: Dict[int, float] = Counter()
        self.mean_cal: Dict[int, Tensor] = {}
        self.target: Dict[str, Tensor] = {}
        self.bias_target: Dict[str, Tensor] = {}
        self.norm: Dict[str, Dict[str, Tensor]] = {}
        self.num_tasks = 0

    def nbytes(self) -> int:
        tensors = [*self.gram.values(), *self.mean_cal.values(), *self.target.values(), *self.bias_target.values()]
        tensors += [t for entry in self.norm.values() for t in entry.values() if isinstance(t, Tensor)]
        return sum(t.nbytes for t in tensors)

    def drop_group(self, gi: int, names: Sequence[str]) -> None:
        """Forget one linear group's sums (solved)."""
        for store, keys in ((self.gram, [gi]), (self.mean_cal, [gi]), (self.target, names), (self.bias_target, names)):
            for key in keys:
                store.pop(key, None)

    def add_linear(self, gi, group, stats, expert_sites, hparams, with_bias):
        omega = task_weight(stats.gram, hparams.eps)
        add_into(self.gram, gi, omega * stats.gram)
        self.omega[gi] += omega
        add_into(self.mean_cal, gi, omega * stats.mean_cal)
        dtype = stats.gram.dtype
        for name in group.names:
            expert = expert_sites[name]
            weight = expert.weight.to(dtype)
            bias = None if expert.bias is None else expert.bias.to(dtype)
            add_into(self.target, name, omega * stats.target(name, weight, bias, hparams.alpha))
            if with_bias and bias is not None:
                add_into(self.bias_target, name, omega * stats.bias_target(name, weight, bias, hparams.alpha))

    def add_norm(self, name, stats, expert_site):
        # Built and summed in the solve's dtype whatever the moments': they are vectors, and float32 products and
        # sums put the last CLIP block's LayerNorm 1.7e-5 (relative) from a float64 build, against the moments'
        # own 8e-7.
        d = SOLVE_DTYPE
        q, z = stats.second_moment.to(d, copy=True), stats.mean.to(d, copy=True)  # add_into adds in place
        gamma = expert_site.weight.to(d)
        beta = expert_site.bias.to(d) if expert_site.bias is not None else None
        entry = {"q": q, "z": z, "r_gamma": q * gamma + (z * beta if beta is not None else 0.0)}
        if beta is not None:
            entry["r_beta"] = z * gamma + beta
        for key, value in entry.items():
            add_into(self.norm.setdefault(name, {}), key, value)

