"""Per-token feature drift between two streams of hidden states (paper Sec. 3.1)."""

from __future__ import annotations

from typing import Callable, Dict, Optional

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

