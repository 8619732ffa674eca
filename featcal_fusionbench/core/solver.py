"""Closed-form FeatCal updates (paper Sec. 4.4 and App. G) on plain tensors.

Nothing here knows about modules, hooks or devices: every function takes the
statistics the engine accumulated and returns new parameter tensors, so each
formula can be tested against an independent minimiser of its objective.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

SOLVE_DTYPE = torch.float64
#: rows and columns of a tile when a system is symmetrised in place (``ridge_system``)
TILE = 1024


class SolveResult(NamedTuple):
    solution: Tensor
    method: str  # "cholesky" or the fallback that was needed


def task_weight(gram: Tensor, eps: float) -> float:
    """omega_i = 1 / max(||G_i||_F, eps) (Eq. 14), the squares summed in SOLVE_DTYPE a tile of rows at a time (a
    float64 copy of a whole 8192-wide Gram would be 512 MiB)."""
    squares = sum(float(rows.to(SOLVE_DTYPE).square().sum()) for rows in gram.split(TILE))
    return 1.0 / max(math.sqrt(squares), eps)


def anchor(merged: Tensor, base: Tensor, rho: float) -> Tensor:
    """rho * merged + (1 - rho) * base (Eq. 11, 51); rho may lie outside [0, 1]. Two float64 buffers, not five."""
    return merged.to(SOLVE_DTYPE, copy=True).mul_(rho).add_(base.to(SOLVE_DTYPE, copy=True).mul_(1.0 - rho))


def ridge_system(gram: Tensor, shift: float) -> Tensor:
    """``0.5 (G + G^T) + shift I`` in SOLVE_DTYPE (accumulated Grams are symmetric only up to rounding), bit for bit,
    built in one d x d buffer: symmetrised a pair of tiles at a time rather than through whole-matrix temporaries,
    which for ``down_proj``'s 8192-wide input are 512 MiB each."""
    system = gram.to(SOLVE_DTYPE, copy=True)
    dim = system.shape[0]
    for i in range(0, dim, TILE):
        for j in range(i, dim, TILE):
            upper, lower = system[i : i + TILE, j : j + TILE], system[j : j + TILE, i : i + TILE]
            mean = 0.5 * (upper + lower.T)  # exactly symmetric where the two tiles are one (i == j)
            upper.copy_(mean)
            lower.copy_(mean.T)
    system.diagonal().add_(shift)
    return system


class SpdFactor:
    """A symmetric positive (semi)definite matrix factorised once, for several right-hand sides: every linear that
    reads one input (q, k and v; gate and up) shares its ridge system, and a candidate's solves at two anchors
    (``engine.step.BlockStep.solve_over_rho``) share one too. Each ``solve`` gives what ``solve_spd`` gives for
    that right-hand side alone, bit for bit.

    Cholesky first; an LU solve when the factorisation breaks down numerically; a least-squares solve when even that
    is singular, so a degenerate module still gets the minimum-norm solution instead of an exception mid-run.

    With ``rebuild`` on the CPU, the factor overwrites ``matrix`` and each solution its column-major ``rhs`` (float64
    tensors the caller gives up), bit for bit as the copying path: torch's ``cholesky_solve`` copies both operands,
    and at ``down_proj``'s 8192-wide input every d x d copy is 512 MiB of host memory. The rare fallbacks get the
    matrix again from ``rebuild()`` for each right-hand side (``rhs`` is untouched until a factor exists).
    """

    def __init__(self, matrix: Tensor, rebuild: Optional[Callable[[], Tensor]] = None):
        matrix = matrix.to(SOLVE_DTYPE)
        self.rebuild = rebuild
        self.in_place = rebuild is not None and matrix.device.type == "cpu"
        if self.in_place:
            # LAPACK works on column-major storage: the transposed view of a row-major symmetric matrix is the
            # same matrix in that layout, so the factorisation and both triangular solves run on the given buffers
            in_place = matrix.mT
            info = torch.empty((), dtype=torch.int32)
            factor, info = torch.linalg.cholesky_ex(in_place, out=(in_place, info))
            self.matrix = None  # overwritten: a fallback rebuilds it
        else:
            factor, info = torch.linalg.cholesky_ex(matrix)
            self.matrix = matrix
        self.factor: Optional[Tensor] = factor if int(info) == 0 else None

    def solve(self, rhs: Tensor) -> SolveResult:
        rhs = rhs.to(SOLVE_DTYPE)
        if self.factor is not None:
            if not self.in_place:
                return SolveResult(torch.cholesky_solve(rhs, self.factor), "cholesky")
            if not rhs.mT.is_contiguous():  # a row-major right-hand side would be solved transposed, in other rounding
                rhs = rhs.mT.contiguous().mT
            torch.linalg.solve_triangular(self.factor, rhs, upper=False, out=rhs)
            torch.linalg.solve_triangular(self.factor.mT, rhs, upper=True, out=rhs)
            return SolveResult(rhs, "cholesky")
        matrix = self.rebuild().to(SOLVE_DTYPE) if self.in_place else self.matrix
        solution, info = torch.linalg.solve_ex(matrix, rhs)
        if int(info) == 0 and bool(torch.isfinite(solution).all()):
            return SolveResult(solution, "lu")
        # gelsd (SVD based) exists on CPU only; the matrices are small enough to move.
        lstsq = torch.linalg.lstsq(matrix.cpu(), rhs.cpu(), driver="gelsd")
        return SolveResult(lstsq.solution.to(matrix.device), "lstsq")


def solve_spd(matrix: Tensor, rhs: Tensor, rebuild: Optional[Callable[[], Tensor]] = None) -> SolveResult:
    """Solve ``matrix @ X = rhs`` for a symmetric positive (semi)definite matrix (``SpdFactor``, one right-hand
    side)."""
    return SpdFactor(matrix, rebuild).solve(rhs)


def ridge_factor(weighted_gram: Tensor, lambda_: float, eps: float) -> SpdFactor:
    """``sum omega G + (lambda + eps) I`` of one input group, factorised (``solve_linear_weight``'s system)."""
    system = partial(ridge_system, weighted_gram, lambda_ + eps)  # built again only for a fallback
    return SpdFactor(system(), rebuild=system)


def solve_linear_weight(
    weighted_gram: Tensor,
    weighted_target: Tensor,
    anchor_weight: Tensor,
    lambda_: float,
    eps: float,
    factor: Optional[SpdFactor] = None,
) -> SolveResult:
    """W* of Eq. 17 with the implementation's epsilon stabiliser.

    Args:
        weighted_gram: sum_i omega_i G_i, shape (d, d).
        weighted_target: sum_i omega_i W_i C_i, shape (m, d).
        anchor_weight: W_anc, shape (m, d).
        factor: ``ridge_factor(weighted_gram, lambda_, eps)`` where the caller shares it (the linears of one input
            group); made here otherwise.

    Returns W* of shape (m, d) solving W (sum omega G + (lambda + eps) I) = sum omega W_i C_i + lambda W_anc.
    """
    # one (m, d) buffer for the right-hand side, not four temporaries
    rhs = anchor_weight.to(SOLVE_DTYPE, copy=True).mul_(lambda_).add_(weighted_target)
    factor = ridge_factor(weighted_gram, lambda_, eps) if factor is None else factor
    result = factor.solve(rhs.T)
    return SolveResult(result.solution.T.contiguous(), result.method)


def solve_bias(
    weight_sum: float,
    weighted_bias_target: Tensor,
    weighted_input_mean: Tensor,
    weight: Tensor,
    anchor_bias: Tensor,
    lambda_: float,
) -> Tensor:
    """b* of Eq. 55, the second-stage bias with W* fixed.

    Args:
        weight_sum: sum_i omega_i.
        weighted_bias_target: sum_i omega_i (b_i + W_i mu_i^tgt), shape (m,).
        weighted_input_mean: sum_i omega_i mu_i^cal, shape (d,).
        weight: the solved W*, shape (m, d).
        anchor_bias: b_anc, shape (m,).
    """
    numerator = (
        weighted_bias_target.to(SOLVE_DTYPE)
        - weight.to(SOLVE_DTYPE) @ weighted_input_mean.to(SOLVE_DTYPE)
        + lambda_ * anchor_bias.to(SOLVE_DTYPE)
    )
    return numerator / (weight_sum + lambda_)


def solve_layernorm_affine(
    sum_second_moment: Tensor,
    sum_mean: Tensor,
    rhs_gamma_data: Tensor,
    rhs_beta_data: Tensor,
    num_tasks: int,
    anchor_gamma: Tensor,
    anchor_beta: Tensor,
    lambda_: float,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(gamma*, beta*) of Eq. 58-59, coordinate-wise 2x2 normal equations.

    Args:
        sum_second_moment: sum_i q_i.
        sum_mean: sum_i zbar_i.
        rhs_gamma_data: sum_i (q_i * gamma_i + zbar_i * beta_i).
        rhs_beta_data: sum_i (zbar_i * gamma_i + beta_i).
        num_tasks: N (equal task weights, as the paper specifies for LayerNorm).
    """
    a11 = sum_second_moment.to(SOLVE_DTYPE) + lambda_
    a12 = sum_mean.to(SOLVE_DTYPE)
    a22 = float(num_tasks) + lambda_
    r_gamma = rhs_gamma_data.to(SOLVE_DTYPE) + lambda_ * anchor_gamma.to(SOLVE_DTYPE)
    r_beta = rhs_beta_data.to(SOLVE_DTYPE) + lambda_ * anchor_beta.to(SOLVE_DTYPE)
    determinant = (a22 * a11 - a12 * a12).clamp_min(eps)
    gamma = (a22 * r_gamma - a12 * r_beta) / determinant
    beta = (a11 * r_beta - a12 * r_gamma) / determinant
    return gamma, beta


def solve_norm_scale(
    sum_second_moment: Tensor,
    rhs_gamma_data: Tensor,
    num_tasks: int,
    anchor_gamma: Tensor,
    lambda_: float,
    eps: float,
) -> Tensor:
    """Scale-only form of Eq. 57 (RMSNorm, no shift): gamma* = (sum q_i gamma_i + lambda gamma_anc) / (sum q_i + lambda)."""
    denominator = (sum_second_moment.to(SOLVE_DTYPE) + lambda_).clamp_min(eps)
    return (rhs_gamma_data.to(SOLVE_DTYPE) + lambda_ * anchor_gamma.to(SOLVE_DTYPE)) / denominator
