"""Streaming, token-weighted moments of module inputs for one task.

Only sums are kept (never a feature matrix beyond the current batch), so the
memory does not grow with the number of calibration examples, and sums from
several ranks add up exactly: ``reduce`` is applied to every raw sum before the
weighted means are formed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]


def _flatten_tokens(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


class NonFiniteError(FloatingPointError):
    """Raised when a statistic or a solved parameter is NaN or infinite."""


def check_finite(tensor: Tensor, what: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteError(
            f"non-finite values in {what}; the model or its inputs overflow "
            "(try accumulation_dtype=float64, or check the experts for NaN weights)"
        )


@dataclass
class LinearInputStats:
    """Weighted means for one linear input group of one task (Eq. 13, 52)."""

    gram: Tensor  # G_i = E[x_cal x_cal^T]
    cross: Tensor  # E[x_exp x_cal^T]
    mean_cal: Tensor  # mu_i^cal
    mean_exp: Tensor  # E[x_exp]

    def target_cross(self, alpha: float) -> Tensor:
        """C_i = E[x_tgt x_cal^T] with x_tgt = alpha x_exp + (1 - alpha) x_cal (Eq. 10, 13)."""
        return alpha * self.cross + (1.0 - alpha) * self.gram

    def target_mean(self, alpha: float) -> Tensor:
        return alpha * self.mean_exp + (1.0 - alpha) * self.mean_cal


class LinearInputMoments:
    """Sums of w, w x_cal, w x_exp, w x_cal x_cal^T and w x_exp x_cal^T over tokens."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.weight_sum = torch.zeros((), dtype=dtype, device=device)
        self.sum_cal = torch.zeros(dim, dtype=dtype, device=device)
        self.sum_exp = torch.zeros(dim, dtype=dtype, device=device)
        # Rows [0, d) hold sum w x_cal x_cal^T, rows [d, 2d) sum w x_exp x_cal^T:
        # both come out of one matmul against the weighted calibrated inputs.
        self.second = torch.zeros(2 * dim, dim, dtype=dtype, device=device)

    def update(self, x_cal: Tensor, x_exp: Tensor, weights: Optional[Tensor]) -> None:
        if x_cal.shape != x_exp.shape:
            raise ValueError(
                f"calibrated and expert inputs differ in shape: {tuple(x_cal.shape)} vs {tuple(x_exp.shape)}"
            )
        xc = _flatten_tokens(x_cal, self.dtype)
        xe = _flatten_tokens(x_exp, self.dtype)
        if weights is None:
            weighted = xc
            self.weight_sum += xc.shape[0]
            self.sum_exp += xe.sum(0)
        else:
            w = weights.reshape(-1).to(self.dtype)
            weighted = xc * w[:, None]
            self.weight_sum += w.sum()
            self.sum_exp += w @ xe
        self.sum_cal += weighted.sum(0)
        self.second.addmm_(torch.cat([xc, xe], dim=1).T, weighted)

    def finalize(self, reduce: Optional[Reduce] = None) -> LinearInputStats:
        sums = [self.weight_sum, self.sum_cal, self.sum_exp, self.second]
        if reduce is not None:
            sums = [reduce(s) for s in sums]
        weight_sum, sum_cal, sum_exp, second = sums
        if float(weight_sum) <= 0:
            raise ValueError("no calibration token carried a positive weight")
        dim = sum_cal.shape[0]
        return LinearInputStats(
            gram=second[:dim] / weight_sum,
            cross=second[dim:] / weight_sum,
            mean_cal=sum_cal / weight_sum,
            mean_exp=sum_exp / weight_sum,
        )


@dataclass
class NormInputStats:
    """zbar_i and q_i of Eq. 56 for one normalisation module of one task."""

    mean: Tensor
    second_moment: Tensor


class NormInputMoments:
    """Sums of w z and w z*z for z = the normalisation without affine (LN_0 or RMS_0)."""

    def __init__(self, dim: int, normalize: Callable[[Tensor], Tensor], dtype, device):
        self.dtype = dtype
        self.normalize = normalize
        self.weight_sum = torch.zeros((), dtype=dtype, device=device)
        self.sum_z = torch.zeros(dim, dtype=dtype, device=device)
        self.sum_zz = torch.zeros(dim, dtype=dtype, device=device)

    def update(self, x_cal: Tensor, weights: Optional[Tensor]) -> None:
        z = self.normalize(_flatten_tokens(x_cal, self.dtype))
        if weights is None:
            self.weight_sum += z.shape[0]
            self.sum_z += z.sum(0)
            self.sum_zz += (z * z).sum(0)
        else:
            w = weights.reshape(-1).to(self.dtype)
            self.weight_sum += w.sum()
            self.sum_z += w @ z
            self.sum_zz += w @ (z * z)

    def finalize(self, reduce: Optional[Reduce] = None) -> NormInputStats:
        sums = [self.weight_sum, self.sum_z, self.sum_zz]
        if reduce is not None:
            sums = [reduce(s) for s in sums]
        weight_sum, sum_z, sum_zz = sums
        if float(weight_sum) <= 0:
            raise ValueError("no calibration token carried a positive weight")
        return NormInputStats(mean=sum_z / weight_sum, second_moment=sum_zz / weight_sum)


def layer_norm_without_affine(normalized_shape, eps: float) -> Callable[[Tensor], Tensor]:
    shape = tuple(normalized_shape)
    return lambda x: F.layer_norm(x, shape, None, None, eps)


def rms_norm_without_scale(eps: float) -> Callable[[Tensor], Tensor]:
    return lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
