"""Tiny models and an independent FeatCal solve from raw features, for the tests."""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn.functional as F
from transformers import CLIPVisionConfig, CLIPVisionModel


def tiny_clip_vision(seed: int = 0, layers: int = 3, hidden: int = 32) -> CLIPVisionModel:
    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        projection_dim=16,
    )
    return CLIPVisionModel(config).eval()


def perturbed(model, scale: float, seed: int):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return out


def task_arithmetic(base, experts, scale: float):
    merged = copy.deepcopy(base)
    base_state = base.state_dict()
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.copy_(base_state[name] + scale * sum(e.state_dict()[name] - base_state[name] for e in experts))
    return merged


def tiny_world(num_tasks: int = 2, seed: int = 0, batches: int = 3, batch_size: int = 4):
    base = tiny_clip_vision(seed)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    data = {t: [torch.randn(batch_size, 3, 16, 16, generator=g) for _ in range(batches)] for t in experts}
    return base, experts, merged, data


def block_module_inputs(model, block_index: int, names: List[str], batches) -> Dict[str, torch.Tensor]:
    """Inputs of a block's modules over all batches, from HF's own full forward (tokens flattened)."""
    block = model.vision_model.encoder.layers[block_index]
    modules = dict(block.named_modules())
    collected = {n: [] for n in names}
    handles = [
        modules[n].register_forward_pre_hook(lambda _m, args, n=n: collected[n].append(args[0].detach()))
        for n in names
    ]
    with torch.no_grad():
        for x in batches:
            model(pixel_values=x)
    for h in handles:
        h.remove()
    return {n: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).double() for n, v in collected.items()}


def independent_linear_solve(x_cal, x_exp, w_exp, b_exp, w_anc, b_anc, lam, alpha, eps, token_weights=None):
    """Minimise Eq. 15 (then Eq. 53 with W* fixed) by stacked least squares over raw tokens."""
    rows_a, rows_b, omegas = [], [], []
    for i, (xc, xe) in enumerate(zip(x_cal, x_exp)):
        w = torch.ones(xc.shape[0], dtype=xc.dtype) if token_weights is None else token_weights[i]
        gram = (xc * w[:, None]).T @ xc / w.sum()
        omega = 1.0 / max(float(torch.linalg.matrix_norm(gram)), eps)
        omegas.append(omega)
        s = (omega * w / w.sum()).sqrt()[:, None]
        x_tgt = alpha * xe + (1 - alpha) * xc
        rows_a.append(s * xc)
        rows_b.append(s * (x_tgt @ w_exp[i].double().T))
    d = x_cal[0].shape[1]
    rows_a += [lam**0.5 * torch.eye(d, dtype=torch.float64), (eps) ** 0.5 * torch.eye(d, dtype=torch.float64)]
    rows_b += [lam**0.5 * w_anc.double().T, torch.zeros(d, w_anc.shape[0], dtype=torch.float64)]
    weight = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution.T
    if b_exp is None:
        return weight, None
    rows_a, rows_b = [], []
    for i, (xc, xe) in enumerate(zip(x_cal, x_exp)):
        w = torch.ones(xc.shape[0], dtype=xc.dtype) if token_weights is None else token_weights[i]
        s = (omegas[i] * w / w.sum()).sqrt()[:, None]
        x_tgt = alpha * xe + (1 - alpha) * xc
        residual = x_tgt @ w_exp[i].double().T + b_exp[i].double() - xc @ weight.T
        rows_a.append(s)
        rows_b.append(s * residual)
    rows_a.append(lam**0.5 * torch.ones(1, 1, dtype=torch.float64))
    rows_b.append(lam**0.5 * b_anc.double()[None, :])
    bias = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution[0]
    return weight, bias


def independent_layernorm_solve(x_cal, ln_eps, gammas, betas, g_anc, b_anc, lam):
    """Minimise Eq. 57 coordinate by coordinate by least squares over raw tokens."""
    d = x_cal[0].shape[1]
    zs = [F.layer_norm(x, (d,), eps=ln_eps) for x in x_cal]
    gamma, beta = torch.empty(d, dtype=torch.float64), torch.empty(d, dtype=torch.float64)
    for k in range(d):
        rows_a, rows_b = [], []
        for z, gi, bi in zip(zs, gammas, betas):
            s = (1.0 / z.shape[0]) ** 0.5
            rows_a.append(s * torch.stack([z[:, k], torch.ones_like(z[:, k])], 1))
            rows_b.append(s * (gi[k].double() * z[:, k] + bi[k].double())[:, None])
        rows_a.append(lam**0.5 * torch.eye(2, dtype=torch.float64))
        rows_b.append(lam**0.5 * torch.stack([g_anc[k], b_anc[k]]).double()[:, None])
        sol = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution[:, 0]
        gamma[k], beta[k] = sol
    return gamma, beta
