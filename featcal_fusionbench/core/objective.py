"""The per-block quadratic objective of a candidate solution on held-out moments (``auto_select``'s criterion
``objective``), as sums over tasks."""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

from .moments import add_into
from .solver import TILE, task_weight

#: every score is computed in float64
SCORE_DTYPE = torch.float64
#: the d x d and m x d sums are kept in float32: each task's moments are accumulated in the run's own dtype and
#: added once, and at the Llama-3.2-3B shape these sums in float64 were 1.46 GiB beside the solve's, all that choosing
#: added to the peak. In the golden cases the scores moved by at most 3e-7 of themselves and no choice changed.
STORE_DTYPE = torch.float32
#: a sum whose SCORE_DTYPE copy is at most this big is converted once when scoring starts (a tiny model's: the
#: conversions per candidate cost more than its products); larger ones stay in STORE_DTYPE, read a tile at a time
SCORE_COPY_BYTES = 64 * 2**20


def _add_scaled(store: Dict, key, value: Tensor, scale: float) -> None:
    """``store[key] += scale * value`` kept in STORE_DTYPE, a tile of rows at a time (the product and the sum in
    ``value``'s dtype, rounded once into the store): no scaled copy of ``value`` beside the sums."""
    if key not in store:
        store[key] = torch.zeros(value.shape, dtype=STORE_DTYPE, device=value.device)
    for total, rows in zip(store[key].split(TILE), value.split(TILE)):
        total.copy_(total.to(value.dtype).add_(rows, alpha=scale))


class HeldoutObjective:
    """Held-out moments of one block summed over tasks, and the objective of any candidate's solution on them.

    The objective is quadratic in the solution, so its task sums are sufficient: like the solve's own sums
    (``block_sums.BlockSums``; both are ``block_sums.TaskSums``), memory does not grow with the number of tasks. Per
    linear module, with each task's omega_i from its held-out Gram (Eq. 14) and y = W_i x_exp + b_i the expert
    module's output:

        sum_i omega_i E_w ||W x_cal + b - y||^2
          = tr(W G W^T) - 2 <W, Y> + 2 b.(W m) + Omega |b|^2 - 2 b.e + const,
        G = sum omega_i E[x_cal x_cal^T], Y = sum omega_i E[y x_cal^T], m = sum omega_i E[x_cal], e = sum omega_i E[y],

    the target being the expert's own features (alpha = 1) whatever the candidate's alpha, so that every candidate
    is scored against the same thing. ``const`` = sum omega_i E||y||^2 is candidate-independent and not in the
    moments: linear terms are reported without it (they can be negative). Per norm (equal task weights, Eq. 57),
    sum_i E ||gamma z + beta - (gamma_i z + beta_i)||^2 is exact, constant included.
    """

    def __init__(self):
        self.gram: Dict[int, Tensor] = {}
        self.mean_cal: Dict[int, Tensor] = {}
        self.omega: Dict[int, float] = {}
        self.group_of: Dict[str, int] = {}
        self.cross: Dict[str, Tensor] = {}
        self.mean_out: Dict[str, Tensor] = {}
        self.norm: Dict[str, Dict[str, Tensor]] = {}
        self.num_tasks = 0

    def nbytes(self) -> int:
        tensors = [*self.gram.values(), *self.mean_cal.values(), *self.cross.values(), *self.mean_out.values()]
        tensors += [t for entry in self.norm.values() for t in entry.values()]
        return sum(t.nbytes for t in tensors)

    def add_linear(self, gi, group, stats, expert_sites, hparams, with_bias=True) -> None:
        d = SCORE_DTYPE
        omega = task_weight(stats.gram, hparams.eps)
        mean_cal = stats.mean_cal.to(d)
        _add_scaled(self.gram, gi, stats.gram, omega)
        add_into(self.mean_cal, gi, omega * mean_cal)
        self.omega[gi] = self.omega.get(gi, 0.0) + omega
        for name in group.names:
            site = expert_sites[name]
            sd = stats.gram.dtype  # the products with the moments in their own dtype, as the solve's targets
            weight = site.weight.to(sd)
            bias = None if site.bias is None else site.bias.to(sd)
            cross = stats.expert_cross(name, weight, bias).to(d)
            mean_out = stats.expert_mean(name, weight, bias).to(d)
            if bias is not None:
                cross, mean_out = cross + torch.outer(bias.to(d), mean_cal), mean_out + bias.to(d)
            self.group_of[name] = gi
            _add_scaled(self.cross, name, cross, omega)
            add_into(self.mean_out, name, omega * mean_out)

    def add_norm(self, name, stats, expert_site) -> None:
        d = SCORE_DTYPE
        q, z = stats.second_moment.to(d, copy=True), stats.mean.to(d, copy=True)  # add_into adds to the sums in place
        gamma = expert_site.weight.to(d)
        beta = None if expert_site.bias is None else expert_site.bias.to(d)
        entry = {"q": q, "r_gamma": q * gamma, "const": q * gamma * gamma}
        if beta is not None:
            entry.update(z=z, r_beta=z * gamma + beta, const=entry["const"] + 2 * z * gamma * beta + beta * beta)
            entry["r_gamma"] = entry["r_gamma"] + z * beta
        for key, value in entry.items():
            add_into(self.norm.setdefault(name, {}), key, value)

    def linear(self, name: str, weight: Tensor, bias: Optional[Tensor]) -> float:
        d = SCORE_DTYPE
        gi = self.group_of[name]
        w = weight.to(d)
        gram, cross = self._scoring(self.gram, gi), self._scoring(self.cross, name)
        # a tile of G's columns (Y's rows) at a time: a float64 copy of down_proj's whole Gram would be 0.5 GiB
        value = sum(((w @ gram[:, j : j + TILE].to(d)) * w[:, j : j + TILE]).sum() for j in range(0, w.shape[1], TILE))
        value = value - 2.0 * sum((rows * y.to(d)).sum() for rows, y in zip(w.split(TILE), cross.split(TILE)))
        if bias is not None:
            b = bias.to(d)
            value = value + 2.0 * b @ (w @ self.mean_cal[gi]) + self.omega[gi] * (b @ b) - 2.0 * b @ self.mean_out[name]
        return float(value)

    def _scoring(self, store: Dict, key) -> Tensor:
        """A stored sum as the scores read it: converted to SCORE_DTYPE once where that copy is small (every
        candidate reads it again), else left in STORE_DTYPE and converted a tile at a time by the reader."""
        value = store[key]
        if value.dtype != SCORE_DTYPE and value.numel() * 8 <= SCORE_COPY_BYTES:
            store[key] = value = value.to(SCORE_DTYPE)
        return value

    def normalization(self, name: str, gamma: Tensor, beta: Optional[Tensor]) -> float:
        d = SCORE_DTYPE
        e = self.norm[name]
        g = gamma.to(d)
        value = (e["q"] * g * g).sum() - 2.0 * (g * e["r_gamma"]).sum() + e["const"].sum()
        if "z" in e:
            b = beta.to(d) if beta is not None else torch.zeros_like(g)
            value = value + 2.0 * (e["z"] * g * b).sum() + self.num_tasks * (b @ b) - 2.0 * (b * e["r_beta"]).sum()
        return float(value)

    def site(self, name: str, params: Mapping[str, Tensor]) -> float:
        """One site's term of the objective for its ``params`` (``weight``, and ``bias`` where it has one)."""
        if name in self.group_of:
            return self.linear(name, params["weight"], params.get("bias"))
        return self.normalization(name, params["weight"], params.get("bias"))
