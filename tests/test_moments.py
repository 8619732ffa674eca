import pytest
import torch

from featcal_fusionbench.core.moments import LinearInputMoments, NormInputMoments, layer_norm_without_affine

CPU = torch.device("cpu")


def one_shot(x_cal, x_exp, w):
    xc, xe, wf = x_cal.reshape(-1, x_cal.shape[-1]).double(), x_exp.reshape(-1, x_exp.shape[-1]).double(), w.reshape(-1).double()
    total = wf.sum()
    return xc, xe, wf, total


@pytest.mark.parametrize("gram_chunk", [768, 3])  # 3: the symmetric Gram is built from upper blocks
def test_streamed_weighted_moments_equal_one_shot_weighted_means(gram_chunk):
    g = torch.Generator().manual_seed(0)
    x_cal = torch.randn(5, 7, 8, generator=g)  # (batch, tokens, dim)
    x_exp = torch.randn(5, 7, 8, generator=g)
    w = torch.rand(5, 7, generator=g)
    weight, bias = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    m = LinearInputMoments(8, torch.float64, CPU, gram_chunk=gram_chunk)
    for b in range(0, 5, 2):
        m.update(x_cal[b : b + 2], x_exp[b : b + 2], w[b : b + 2])
    stats = m.finalize()
    xc, xe, wf, total = one_shot(x_cal, x_exp, w)
    torch.testing.assert_close(stats.gram, (xc * wf[:, None]).T @ xc / total)
    torch.testing.assert_close(stats.cross, (xe * wf[:, None]).T @ xc / total)
    torch.testing.assert_close(stats.mean_cal, (wf @ xc) / total)
    alpha = 0.3
    x_tgt = alpha * xe + (1 - alpha) * xc
    torch.testing.assert_close(stats.target("m", weight, bias, alpha), weight @ ((x_tgt * wf[:, None]).T @ xc / total))
    torch.testing.assert_close(stats.bias_target("m", weight, bias, alpha), bias + weight @ (wf @ x_tgt / total))


def test_the_gram_is_completed_in_its_own_buffer_as_the_upper_triangle_mirrored_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    m = LinearInputMoments(10, torch.float32, CPU, gram_chunk=4)
    for _ in range(3):
        m.update(torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g), torch.rand(6, generator=g))
    raw, weight_sum, buffer = m.gram.clone(), float(m.weight_sum), m.gram.data_ptr()
    stats = m.finalize()
    assert stats.gram.data_ptr() == buffer
    assert torch.equal(stats.gram, (torch.triu(raw) + torch.triu(raw, diagonal=1).T) / weight_sum)
    assert torch.equal(stats.gram, stats.gram.T)


def test_projected_expert_side_equals_the_cross_moment_form():
    """With the expert modules' outputs y = W x_exp + b, the targets equal those of the d x d form."""
    g = torch.Generator().manual_seed(3)
    x_cal, x_exp = torch.randn(4, 6, 10, generator=g), torch.randn(4, 6, 10, generator=g)
    w = torch.rand(4, 6, generator=g)
    modules = {n: torch.nn.Linear(10, 3).double() for n in ("a", "b")}
    cross = LinearInputMoments(10, torch.float64, CPU)
    projected = LinearInputMoments(10, torch.float64, CPU, out_dims={"a": 3, "b": 3})
    for b in range(4):
        cross.update(x_cal[b : b + 1], x_exp[b : b + 1], w[b : b + 1])
        outputs = {n: m(x_exp[b : b + 1].double()) for n, m in modules.items()}
        projected.update(x_cal[b : b + 1], None, w[b : b + 1], outputs)
    s_cross, s_proj = cross.finalize(), projected.finalize()
    for name, module in modules.items():
        weight, bias = module.weight.detach(), module.bias.detach()
        torch.testing.assert_close(s_proj.target(name, weight, bias, 0.4), s_cross.target(name, weight, bias, 0.4))
        torch.testing.assert_close(s_proj.bias_target(name, weight, bias, 0.4), s_cross.bias_target(name, weight, bias, 0.4))


def test_reduce_hook_sums_shards_exactly_like_one_stream():
    """Two shards whose sums are added before the means are formed equal one unsharded stream."""
    g = torch.Generator().manual_seed(1)
    x_cal, x_exp = torch.randn(6, 3, 4, generator=g), torch.randn(6, 3, 4, generator=g)
    whole = LinearInputMoments(4, torch.float64, CPU)
    whole.update(x_cal, x_exp, None)
    shards = [LinearInputMoments(4, torch.float64, CPU) for _ in range(2)]
    shards[0].update(x_cal[:2], x_exp[:2], None)
    shards[1].update(x_cal[2:], x_exp[2:], None)
    peers = iter(shards[1]._sums())
    reduced = shards[0].finalize(reduce=lambda t: t + next(peers))
    expected = whole.finalize()
    torch.testing.assert_close(reduced.gram, expected.gram)
    torch.testing.assert_close(reduced.cross, expected.cross)


def test_norm_moments_use_layernorm_without_affine():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=g) * 4 + 1
    ln = torch.nn.LayerNorm(8, eps=1e-5)
    m = NormInputMoments(8, layer_norm_without_affine(ln.normalized_shape, ln.eps), torch.float64, CPU)
    m.update(x, None)
    stats = m.finalize()
    z = torch.nn.functional.layer_norm(x.double(), (8,), eps=1e-5).reshape(-1, 8)
    torch.testing.assert_close(stats.mean, z.mean(0))
    torch.testing.assert_close(stats.second_moment, (z * z).mean(0))
