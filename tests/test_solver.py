"""Every closed form equals an independent minimiser of its objective (Eq. 15, 53, 57).

The independent route never forms the paper's moments: it stacks the raw
per-sample residuals of the objective into one least-squares problem and hands it
to ``torch.linalg.lstsq``; the gradient of the objective, by autograd, must vanish too.
"""

import pytest
import torch

from featcal_fusionbench.core import solver
from featcal_fusionbench.core.moments import LinearInputMoments
from featcal_fusionbench.core.solver import (
    anchor,
    solve_bias,
    solve_layernorm_affine,
    solve_linear_weight,
    solve_norm_scale,
    solve_spd,
    task_weight,
)

D, M, N_TASKS, N = 6, 5, 3, 40
LAM, RHO, ALPHA, EPS = 0.3, 1.7, 0.4, 1e-12


@pytest.fixture(autouse=True, scope="module")
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(0)
    # Tasks with very different feature scales, so the omega weights matter.
    x_cal = [torch.randn(D, N, generator=g) * (1 + 3 * i) for i in range(N_TASKS)]
    x_exp = [x + 0.5 * torch.randn(D, N, generator=g) for x in x_cal]
    w_exp = [torch.randn(M, D, generator=g) for _ in range(N_TASKS)]
    b_exp = [torch.randn(M, generator=g) for _ in range(N_TASKS)]
    w_mer, w_base = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    b_mer, b_base = torch.randn(M, generator=g), torch.randn(M, generator=g)
    return dict(x_cal=x_cal, x_exp=x_exp, w_exp=w_exp, b_exp=b_exp, w_mer=w_mer, w_base=w_base, b_mer=b_mer, b_base=b_base)


def moments_of(p):
    stats = []
    for xc, xe in zip(p["x_cal"], p["x_exp"]):
        m = LinearInputMoments(D, torch.float64, torch.device("cpu"))
        for chunk in range(0, N, 7):  # streamed in uneven batches
            m.update(xc[:, chunk : chunk + 7].T, xe[:, chunk : chunk + 7].T, None)
        stats.append(m.finalize())
    return stats


def lstsq(blocks):
    a = torch.cat([a for a, _ in blocks])
    b = torch.cat([b for _, b in blocks])
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


def solve_weight_via_moments(p, stats):
    omegas = [task_weight(s.gram, EPS) for s in stats]
    gram = sum(o * s.gram for o, s in zip(omegas, stats))
    target = sum(o * s.target("m", w, None, ALPHA) for o, w, s in zip(omegas, p["w_exp"], stats))
    w_anc = anchor(p["w_mer"], p["w_base"], RHO)
    return solve_linear_weight(gram, target, w_anc, LAM, EPS).solution, omegas


def weight_objective(w, p, omegas):
    """Eq. 15 evaluated on raw features, plus the implementation's eps * ||W||^2 stabiliser."""
    total = LAM * (w - anchor(p["w_mer"], p["w_base"], RHO)).pow(2).sum() + EPS * w.pow(2).sum()
    for o, xc, xe, wi in zip(omegas, p["x_cal"], p["x_exp"], p["w_exp"]):
        x_tgt = ALPHA * xe + (1 - ALPHA) * xc
        total = total + o / N * (w @ xc - wi @ x_tgt).pow(2).sum()
    return total


def test_task_weight_is_inverse_frobenius_norm_clamped_by_eps():
    gram = torch.diag(torch.tensor([3.0, 4.0]))
    assert task_weight(gram, 1e-8) == pytest.approx(1 / 5)
    assert task_weight(torch.zeros(2, 2), 0.5) == pytest.approx(2.0)


def test_linear_weight_equals_least_squares_minimiser_of_eq15(problem):
    p = problem
    w_star, omegas = solve_weight_via_moments(p, moments_of(p))
    w_anc = anchor(p["w_mer"], p["w_base"], RHO)
    blocks = []
    for o, xc, xe, wi in zip(omegas, p["x_cal"], p["x_exp"], p["w_exp"]):
        s = (o / N) ** 0.5
        blocks.append((s * xc.T, s * (wi @ (ALPHA * xe + (1 - ALPHA) * xc)).T))
    blocks.append((LAM**0.5 * torch.eye(D), LAM**0.5 * w_anc.T))
    blocks.append((EPS**0.5 * torch.eye(D), torch.zeros(D, M)))
    independent = lstsq(blocks).T
    torch.testing.assert_close(w_star, independent, rtol=1e-8, atol=1e-9)

    w = w_star.clone().requires_grad_(True)
    weight_objective(w, p, omegas).backward()
    assert w.grad.abs().max() < 1e-9


def test_bias_equals_least_squares_minimiser_of_eq53_on_raw_samples(problem):
    p = problem
    stats = moments_of(p)
    w_star, omegas = solve_weight_via_moments(p, stats)
    b_anc = anchor(p["b_mer"], p["b_base"], RHO)
    bias = solve_bias(
        sum(omegas),
        sum(o * s.bias_target("m", wi, bi, ALPHA) for o, bi, wi, s in zip(omegas, p["b_exp"], p["w_exp"], stats)),
        sum(o * s.mean_cal for o, s in zip(omegas, stats)),
        w_star,
        b_anc,
        LAM,
    )
    # With W* fixed, the bias minimises the per-sample residuals of Eq. 53's data form.
    blocks = []
    for o, xc, xe, wi, bi in zip(omegas, p["x_cal"], p["x_exp"], p["w_exp"], p["b_exp"]):
        s = (o / N) ** 0.5
        x_tgt = ALPHA * xe + (1 - ALPHA) * xc
        residual_target = (wi @ x_tgt + bi[:, None] - w_star @ xc).T  # (N, M): each row is one sample
        blocks.append((s * torch.ones(N, 1), s * residual_target))
    blocks.append((LAM**0.5 * torch.ones(1, 1), LAM**0.5 * b_anc[None, :]))
    independent = lstsq(blocks)[0]
    torch.testing.assert_close(bias, independent, rtol=1e-9, atol=1e-10)


def test_layernorm_affine_equals_least_squares_minimiser_of_eq57():
    g = torch.Generator().manual_seed(1)
    z = [torch.randn(N, D, generator=g) * (i + 1) + i for i in range(N_TASKS)]
    gammas = [torch.randn(D, generator=g) for _ in range(N_TASKS)]
    betas = [torch.randn(D, generator=g) for _ in range(N_TASKS)]
    g_anc, b_anc = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q = [(zi * zi).mean(0) for zi in z]
    zbar = [zi.mean(0) for zi in z]
    gamma, beta = solve_layernorm_affine(
        sum(q), sum(zbar),
        sum(qi * gi + zi * bi for qi, zi, gi, bi in zip(q, zbar, gammas, betas)),
        sum(zi * gi + bi for zi, gi, bi in zip(zbar, gammas, betas)),
        N_TASKS, g_anc, b_anc, LAM, 1e-12,
    )
    for k in range(D):  # the objective separates across coordinates
        blocks = []
        for zi, gi, bi in zip(z, gammas, betas):
            s = (1 / N) ** 0.5
            design = torch.stack([zi[:, k], torch.ones(N)], dim=1)
            blocks.append((s * design, s * (gi[k] * zi[:, k] + bi[k])[:, None]))
        blocks.append((LAM**0.5 * torch.eye(2), LAM**0.5 * torch.stack([g_anc[k], b_anc[k]])[:, None]))
        independent = lstsq(blocks)[:, 0]
        torch.testing.assert_close(torch.stack([gamma[k], beta[k]]), independent, rtol=1e-9, atol=1e-10)


def test_norm_scale_only_equals_least_squares_minimiser():
    g = torch.Generator().manual_seed(2)
    z = [torch.randn(N, D, generator=g) * (i + 1) for i in range(N_TASKS)]
    gammas = [torch.randn(D, generator=g) for _ in range(N_TASKS)]
    g_anc = torch.randn(D, generator=g)
    q = [(zi * zi).mean(0) for zi in z]
    gamma = solve_norm_scale(sum(q), sum(qi * gi for qi, gi in zip(q, gammas)), N_TASKS, g_anc, LAM, 1e-12)
    for k in range(D):
        blocks = [((1 / N) ** 0.5 * zi[:, k : k + 1], (1 / N) ** 0.5 * (gi[k] * zi[:, k])[:, None]) for zi, gi in zip(z, gammas)]
        blocks.append((LAM**0.5 * torch.ones(1, 1), LAM**0.5 * g_anc[k].reshape(1, 1)))
        torch.testing.assert_close(gamma[k], lstsq(blocks)[0, 0], rtol=1e-9, atol=1e-10)


def test_huge_lambda_returns_the_anchor(problem):
    p = problem
    stats = moments_of(p)
    omegas = [task_weight(s.gram, EPS) for s in stats]
    gram = sum(o * s.gram for o, s in zip(omegas, stats))
    target = sum(o * s.target("m", w, None, ALPHA) for o, w, s in zip(omegas, p["w_exp"], stats))
    w_anc = anchor(p["w_mer"], p["w_base"], RHO)
    w_star = solve_linear_weight(gram, target, w_anc, 1e12, EPS).solution
    torch.testing.assert_close(w_star, w_anc, rtol=1e-9, atol=1e-9)


def test_solve_spd_falls_back_when_cholesky_fails():
    rhs = torch.randn(3, 2)
    ok = solve_spd(torch.eye(3) * 2, rhs)
    assert ok.method == "cholesky"
    torch.testing.assert_close(ok.solution, rhs / 2)
    indefinite = torch.diag(torch.tensor([1.0, -2.0, 3.0]))
    lu = solve_spd(indefinite, rhs)
    assert lu.method == "lu"
    torch.testing.assert_close(indefinite @ lu.solution, rhs)
    singular = torch.diag(torch.tensor([1.0, 0.0, 3.0]))
    ls = solve_spd(singular, rhs)
    assert ls.method == "lstsq"
    expected = torch.linalg.pinv(singular) @ rhs
    torch.testing.assert_close(ls.solution, expected)


@pytest.mark.parametrize("dim, tile", [(20, 7), (16, 8), (5, 1024)])
def test_the_ridge_system_is_built_in_place_bit_for_bit_as_the_whole_matrix_formula(dim, tile, monkeypatch):
    """Tiles of any size (a last partial one, one tile for all) give exactly 0.5 (G + G^T) + shift I, from a float32
    Gram that is not symmetric, and leave the Gram as it was."""
    monkeypatch.setattr(solver, "TILE", tile)
    gram = torch.randn(dim, dim, generator=torch.Generator().manual_seed(dim)).float()
    before = gram.clone()
    system = solver.ridge_system(gram, 0.37)
    full = gram.double() + 0.37 * torch.eye(dim, dtype=torch.float64)
    assert torch.equal(system, 0.5 * (full + full.T)) and system.dtype == solver.SOLVE_DTYPE
    assert torch.equal(gram, before)


@pytest.mark.parametrize("column_major", [True, False])
def test_factoring_in_place_gives_the_same_solution_bit_for_bit_and_rebuilds_for_the_fallbacks(column_major):
    """The in-place path (the factor in the system's buffer, the solution in the right-hand side's) equals torch's
    copying ``cholesky_solve`` exactly, with the right-hand side in either layout (solve_linear_weight gives a
    column-major one); an indefinite system is rebuilt for the LU fallback."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(40, 40, dtype=torch.float64, generator=generator)
    spd = a @ a.T + torch.eye(40, dtype=torch.float64)
    spd = 0.5 * (spd + spd.T)  # exactly symmetric, as ridge_system builds every system
    rhs = torch.randn(5, 40, dtype=torch.float64, generator=generator).T
    rhs = rhs if column_major else rhs.contiguous()
    copied = solve_spd(spd, rhs)
    matrix, given = spd.clone(), rhs.clone()
    in_place = solve_spd(matrix, given, rebuild=spd.clone)
    assert in_place.method == copied.method == "cholesky" and torch.equal(in_place.solution, copied.solution)
    assert (in_place.solution.data_ptr() == given.data_ptr()) == column_major and not torch.equal(matrix, spd)
    indefinite = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    lu = solve_spd(indefinite.clone(), rhs[:3].clone(), rebuild=indefinite.clone)
    assert lu.method == "lu"
    torch.testing.assert_close(indefinite @ lu.solution, rhs[:3])


def test_the_linear_solve_equals_the_copying_solve_bit_for_bit():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64, 30, generator=generator)
    gram = x.T @ x
    target, anchor_weight = (torch.randn(7, 30, generator=generator) for _ in range(2))
    system = solver.ridge_system(gram, 0.1 + EPS)
    rhs = target.double() + 0.1 * anchor_weight.double()
    expected = torch.cholesky_solve(rhs.T, torch.linalg.cholesky(system)).T
    assert torch.equal(solve_linear_weight(gram, target, anchor_weight, 0.1, EPS).solution, expected)


def test_a_shared_factor_solves_each_right_hand_side_as_its_own_solve_would():
    """One factorisation per input group (q, k and v; gate and up) and per candidate's two anchors: each linear's
    solution from the shared factor equals its own solve bit for bit, in place or copying, and a system that
    cannot be factorised falls back for every right-hand side (rebuilt each time)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 30, generator=generator)
    gram = x.T @ x
    members = [tuple(torch.randn(m, 30, generator=generator) for _ in range(2)) for m in (7, 3, 7)]
    factor = solver.ridge_factor(gram, 0.1, EPS)
    for target, anchor_weight in members:
        alone = solve_linear_weight(gram, target, anchor_weight, 0.1, EPS)
        shared = solve_linear_weight(gram, target, anchor_weight, 0.1, EPS, factor=factor)
        assert shared.method == alone.method == "cholesky" and torch.equal(shared.solution, alone.solution)
    spd = solver.ridge_system(gram, 0.1 + EPS)
    copying = solver.SpdFactor(spd)
    for target, _ in members:
        assert torch.equal(copying.solve(target.T).solution, solve_spd(spd, target.T).solution)
    assert torch.equal(spd, solver.ridge_system(gram, 0.1 + EPS))  # the copying path leaves the system as it was
    indefinite = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    rebuilt = []
    failing = solver.SpdFactor(indefinite.clone(), rebuild=lambda: rebuilt.append(1) or indefinite.clone())
    for k in range(2):
        rhs = torch.randn(3, 2, generator=generator)
        result = failing.solve(rhs.clone())
        assert result.method == "lu"
        torch.testing.assert_close(indefinite @ result.solution, rhs)
    assert rebuilt == [1, 1]
