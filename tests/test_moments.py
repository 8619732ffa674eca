import torch

from featcal_fusionbench.moments import (
    LinearInputMoments,
    NormInputMoments,
    layer_norm_without_affine,
)


def test_streamed_weighted_moments_equal_one_shot_weighted_means():
    g = torch.Generator().manual_seed(0)
    x_cal = torch.randn(5, 7, 4, generator=g)  # (batch, tokens, dim)
    x_exp = torch.randn(5, 7, 4, generator=g)
    w = torch.rand(5, 7, generator=g)
    m = LinearInputMoments(4, torch.float64, torch.device("cpu"))
    for b in range(0, 5, 2):
        m.update(x_cal[b : b + 2], x_exp[b : b + 2], w[b : b + 2])
    stats = m.finalize()
    xc, xe, wf = x_cal.reshape(-1, 4).double(), x_exp.reshape(-1, 4).double(), w.reshape(-1).double()
    total = wf.sum()
    torch.testing.assert_close(stats.gram, (xc * wf[:, None]).T @ xc / total)
    torch.testing.assert_close(stats.cross, (xe * wf[:, None]).T @ xc / total)
    torch.testing.assert_close(stats.mean_cal, (wf @ xc) / total)
    torch.testing.assert_close(stats.mean_exp, (wf @ xe) / total)
    alpha = 0.3
    x_tgt = alpha * xe + (1 - alpha) * xc
    torch.testing.assert_close(stats.target_cross(alpha), (x_tgt * wf[:, None]).T @ xc / total)


def test_reduce_hook_sums_shards_exactly_like_one_stream():
    """Two shards whose sums are added before the means are formed equal one unsharded stream."""
    g = torch.Generator().manual_seed(1)
    x_cal, x_exp = torch.randn(6, 3, 4, generator=g), torch.randn(6, 3, 4, generator=g)
    whole = LinearInputMoments(4, torch.float64, torch.device("cpu"))
    whole.update(x_cal, x_exp, None)
    shards = [LinearInputMoments(4, torch.float64, torch.device("cpu")) for _ in range(2)]
    shards[0].update(x_cal[:2], x_exp[:2], None)
    shards[1].update(x_cal[2:], x_exp[2:], None)
    peers = iter([shards[1].weight_sum, shards[1].sum_cal, shards[1].sum_exp, shards[1].second])
    reduced = shards[0].finalize(reduce=lambda t: t + next(peers))
    expected = whole.finalize()
    torch.testing.assert_close(reduced.gram, expected.gram)
    torch.testing.assert_close(reduced.cross, expected.cross)


def test_norm_moments_use_layernorm_without_affine():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=g) * 4 + 1
    ln = torch.nn.LayerNorm(8, eps=1e-5)
    m = NormInputMoments(8, layer_norm_without_affine(ln.normalized_shape, ln.eps), torch.float64, torch.device("cpu"))
    m.update(x, None)
    stats = m.finalize()
    z = torch.nn.functional.layer_norm(x.double(), (8,), eps=1e-5).reshape(-1, 8)
    torch.testing.assert_close(stats.mean, z.mean(0))
    torch.testing.assert_close(stats.second_moment, (z * z).mean(0))
