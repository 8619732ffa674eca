"""Per-token feature drift between two streams of hidden states (paper Sec. 3.1)."""

from __future__ import annotations

from typing import Dict, Optional

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

    def result(self) -> Dict[str, float]:
        if self.count == 0:
            return {"l2": float("nan"), "cosine": float("nan")}
        return {"l2": self.l2 / self.count, "cosine": self.cosine / self.count}


def stream_drift(hidden, reference, masks=None) -> Dict[str, float]:
    meter = DriftMeter()
    for i, (h, r) in enumerate(zip(hidden, reference)):
        meter.update(h, r, None if masks is None else masks[i])
    return meter.result()

