"""Streaming, token-weighted moments of module inputs for one task.

Only sums are kept (never a feature matrix beyond the current batch), so the
memory does not grow with the number of calibration examples, and sums from
several ranks add up exactly: ``reduce`` is applied to every raw sum before the
weighted means are formed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]


def _flatten_tokens(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


def add_into(store: Dict, key, value) -> None:
    """``store[key] += value``, starting the sum at ``value`` (a block's sums over tasks). The sum is added to in
    place (at ``down_proj``'s 8192-wide input a new sum would be another 256 MiB), so ``value`` must be a tensor that
    no one else holds when it starts a sum."""
    if key in store:
        store[key] += value
    else:
        store[key] = value


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
    """Weighted means for one linear input group of one task (Eq. 13, 52).

    The expert side is kept in one of two forms: ``cross`` = E[x_exp x_cal^T] (d x d, shared by
    the group's modules), or per module ``out_cross`` = E[y_exp x_cal^T] and ``out_mean`` = E[y_exp]
    with y_exp = W_i x_exp + b_i the expert module's own output (m x d: cheaper when m < d).
    """

    gram: Tensor  # G_i = E[x_cal x_cal^T]
    mean_cal: Tensor  # mu_i^cal
    cross: Optional[Tensor] = None
    mean_exp: Optional[Tensor] = None
    out_cross: Optional[Dict[str, Tensor]] = None
    out_mean: Optional[Dict[str, Tensor]] = None

    def tensors(self) -> List[Tensor]:
        out = [self.gram, self.mean_cal]
        out += [t for t in (self.cross, self.mean_exp) if t is not None]
        for store in (self.out_cross, self.out_mean):
            out += list((store or {}).values())
        return out

    def expert_cross(self, name: str, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """W_i E[x_exp x_cal^T]."""
        if self.cross is not None:
            return weight @ self.cross
        cross = self.out_cross[name]
        return cross if bias is None else cross - torch.outer(bias, self.mean_cal)

    def expert_mean(self, name: str, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """W_i E[x_exp]."""
        if self.cross is not None:
            return weight @ self.mean_exp
        mean = self.out_mean[name]
        return mean if bias is None else mean - bias

    def target(self, name: str, weight: Tensor, bias: Optional[Tensor], alpha: float) -> Tensor:
        """W_i C_i with C_i = E[x_tgt x_cal^T], x_tgt = alpha x_exp + (1 - alpha) x_cal (Eq. 10, 13). In the cross
        form C_i is mixed first: one m x d x d product per task instead of two, which with few calibration tokens
        (fewer than d per task) costs more than the forward passes do."""
        if self.cross is not None:
            return weight @ torch.lerp(self.gram, self.cross, alpha)
        return alpha * self.expert_cross(name, weight, bias) + (1.0 - alpha) * (weight @ self.gram)

    def bias_target(self, name: str, weight: Tensor, bias: Tensor, alpha: float) -> Tensor:
        """b_i + W_i mu_i^tgt (Eq. 53)."""
        return bias + alpha * self.expert_mean(name, weight, bias) + (1.0 - alpha) * (weight @ self.mean_cal)


def _chunks(dim: int, size: int) -> List[slice]:
    return [slice(i, min(i + size, dim)) for i in range(0, dim, size)]


class LinearInputMoments:
    """Streaming sums for one input group: w, w x_cal, w x_cal x_cal^T, and the expert side.

    The Gram matrix is symmetric: only its upper blocks are accumulated (in chunks of
    ``gram_chunk`` columns) and the lower ones are filled in at the end. ``out_dims`` switches the
    expert side to the projected form (see LinearInputStats) for modules of those output sizes.
    """

    def __init__(
        self, dim: int, dtype: torch.dtype, device: torch.device,
        out_dims: Optional[Dict[str, int]] = None, gram_chunk: int = 768,
    ):
        self.dtype = dtype
        self.dim = dim
        self.blocks = _chunks(dim, gram_chunk)
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.weight_sum = zeros(())
        self.sum_cal = zeros(dim)
        self.gram = zeros(dim, dim)
        self.projected = out_dims is not None
        if self.projected:
            self.out_sum = {n: zeros(m) for n, m in out_dims.items()}
            self.out_cross = {n: zeros(m, dim) for n, m in out_dims.items()}
        else:
            self.sum_exp = zeros(dim)
            self.cross = zeros(dim, dim)

    def _sums(self) -> List[Tensor]:
        if self.projected:
            return [self.weight_sum, self.sum_cal, self.gram, *self.out_sum.values(), *self.out_cross.values()]
        return [self.weight_sum, self.sum_cal, self.gram, self.sum_exp, self.cross]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._sums())

    def update(self, x_cal: Tensor, x_exp: Optional[Tensor], weights: Optional[Tensor],
               y_exp: Optional[Dict[str, Tensor]] = None) -> None:
        """Add one batch: calibrated inputs, expert inputs (cross form) or expert outputs (projected form)."""
        xc = _flatten_tokens(x_cal, self.dtype)
        w = None if weights is None else weights.reshape(-1).to(self.dtype)
        weighted = xc if w is None else xc * w[:, None]
        self.weight_sum += xc.shape[0] if w is None else w.sum()
        self.sum_cal += weighted.sum(0)
        for i, rows in enumerate(self.blocks):
            for cols in self.blocks[i:]:
                self.gram[rows, cols].addmm_(xc[:, rows].T, weighted[:, cols])
        if self.projected:
            for name, y in y_exp.items():
                ye = _flatten_tokens(y, self.dtype)
                self.out_sum[name] += ye.sum(0) if w is None else w @ ye
                self.out_cross[name].addmm_(ye.T, weighted)
        else:
            if x_cal.shape != x_exp.shape:
                raise ValueError(
                    f"calibrated and expert inputs differ in shape: {tuple(x_cal.shape)} vs {tuple(x_exp.shape)}"
                )
            xe = _flatten_tokens(x_exp, self.dtype)
            self.sum_exp += xe.sum(0) if w is None else w @ xe
            self.cross.addmm_(xe.T, weighted)

    def finalize(self, reduce: Optional[Reduce] = None) -> LinearInputStats:
        """The weighted means. The Gram matrix is completed and divided in its own buffer (a d x d temporary is
        256 MiB at an 8192-wide input), so the moments are spent: finalise once."""
        sums = self._sums()
        if reduce is not None:
            sums = [reduce(s) for s in sums]
        weight_sum, sum_cal, gram = sums[:3]
        if float(weight_sum) <= 0:
            raise ValueError("no calibration token carried a positive weight")
        # Blocks below the diagonal were never written: mirror the upper triangle into them, as
        # triu(G) + triu(G, 1)^T would, bit for bit.
        for i, rows in enumerate(self.blocks):
            diagonal = gram[rows, rows]
            diagonal.copy_(torch.triu(diagonal) + torch.triu(diagonal, diagonal=1).T)
            for cols in self.blocks[i + 1 :]:
                gram[cols, rows] = gram[rows, cols].T
        stats = LinearInputStats(gram=gram.div_(weight_sum), mean_cal=sum_cal / weight_sum)
        if self.projected:
            k = len(self.out_sum)
            names = list(self.out_sum)
            stats.out_mean = {n: t / weight_sum for n, t in zip(names, sums[3 : 3 + k])}
            stats.out_cross = {n: t / weight_sum for n, t in zip(names, sums[3 + k :])}
        else:
            stats.mean_exp = sums[3] / weight_sum
            stats.cross = sums[4] / weight_sum
        return stats


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

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight_sum, self.sum_z, self.sum_zz))

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
