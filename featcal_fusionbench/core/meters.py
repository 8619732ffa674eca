"""Per-token feature drift between two streams of hidden states (paper Sec. 3.1)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


class DriftMeter:
    """Streams the mean L2 distance and mean cosine similarity over valid tokens."""

    def __init__(self):
        self.l2 = 0.0
        self.cosine = 0.0
        self.count = 0.0

    def update(self, hidden: Tensor, reference: Tensor, mask: Optional[Tensor] = None) -> None:
        a = hidden.reshape(-1, hidden.shape[-1]).float()
        b = reference.reshape(-1, reference.shape[-1]).float()
        l2 = (a - b).norm(dim=-1)
        cos = F.cosine_similarity(a, b, dim=-1)
        if mask is not None:
            keep = mask.reshape(-1).bool()
            l2, cos = l2[keep], cos[keep]
        self.l2 += float(l2.sum())
        self.cosine += float(cos.sum())
        self.count += l2.numel()

    def result(self, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> Dict[str, float]:
        l2, cosine, count = self.l2, self.cosine, self.count
        if reduce is not None:  # sums from every rank's shard
            l2, cosine, count = reduce(torch.tensor([l2, cosine, count], dtype=torch.float64)).tolist()
        if count == 0:
            return {"l2": float("nan"), "cosine": float("nan")}
        return {"l2": l2 / count, "cosine": cosine / count}



class AgreementMeter:
    """Fraction of held-out tokens whose argmax prediction equals the expert's."""

    def __init__(self):
        self.agree = 0
        self.count = 0

    def update(self, logits: Tensor, expert_predictions: Tensor, mask: Optional[Tensor] = None) -> None:
        same = logits.argmax(-1) == expert_predictions
        if mask is not None:
            same = same[mask.bool()]
        self.agree += int(same.sum())
        self.count += same.numel()

    def result(self) -> float:
        return self.agree / self.count if self.count else float("nan")



def example_cosines(hidden: Tensor, reference: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Each example's mean cosine similarity to its reference over its valid tokens (examples on the leading axis),
    in float64."""
    cosine = F.cosine_similarity(hidden.double(), reference.double(), dim=-1).reshape(hidden.shape[0], -1)
    if mask is None:
        return cosine.mean(dim=1)
    keep = mask.reshape(hidden.shape[0], -1).to(cosine.dtype)
    return (cosine * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)


def average_ranks(values: Tensor) -> Tensor:
    """1-based ranks of a 1-D tensor, tied values sharing their mean rank (float64)."""
    order = values.argsort(stable=True)
    _, inverse, counts = torch.unique_consecutive(values[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = torch.empty(values.numel(), dtype=torch.float64)
    ranks[order] = ((ends - counts + 1 + ends) / 2)[inverse]
    return ranks


def rank_agreement(values: Tensor, reference: Tensor) -> Tensor:
    """Each example's share of Spearman's rho between ``values`` and ``reference`` (1-D, the same examples): the
    product of its two standardised average ranks, whose mean over the examples is rho, ties included (Pearson's r
    of the ranks). All zero where either side is constant, where rho is undefined."""
    ranks = [average_ranks(v.double()) for v in (values, reference)]
    spread = [r.std(unbiased=False) for r in ranks]
    if min(spread) == 0:
        return torch.zeros(values.numel(), dtype=torch.float64)
    return ((ranks[0] - ranks[0].mean()) / spread[0]) * ((ranks[1] - ranks[1].mean()) / spread[1])


def paired_difference(first: Mapping[str, Tensor], second: Mapping[str, Tensor]) -> Tuple[float, float]:
    """The mean over tasks of each task's mean per-example difference ``first - second`` (the same examples in
    both), and its standard error: tasks independent, each task's examples paired."""
    means, variances = [], []
    for task, values in first.items():
        difference = (values - second[task]).double()
        means.append(float(difference.mean()))
        count = difference.numel()
        variances.append(float(difference.var(unbiased=True)) / count if count > 1 else math.inf)
    tasks = len(means)
    return sum(means) / tasks, math.sqrt(sum(variances)) / tasks
