"""FeatCal on tiny T5 models: padding, forward order (encoder first), and the closed forms. What every family
keeps (the walk, identity, anchors, dtypes) is in test_family_contract.py."""

import copy

import pytest
import torch

from featcal_fusionbench.families.t5 import T5Family, trim_padding
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.core.hparams import FeatCalHParams

from helpers import independent_linear_solve, t5_batch, tiny_t5_world

ENC_LINEARS = ["layer.0.SelfAttention." + m for m in "qkvo"] + ["layer.1.DenseReluDense." + m for m in ("wi_0", "wi_1", "wo")]
DEC_LINEARS = (
    ["layer.0.SelfAttention." + m for m in "qkvo"]
    + ["layer.1.EncDecAttention." + m for m in "qkvo"]
    + ["layer.2.DenseReluDense." + m for m in ("wi_0", "wi_1", "wo")]
)
CROSS_KV = {"layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v"}


def calibrate(merged, base, experts, data, **overrides):
    hp = FeatCalHParams(**{"num_calibration_examples": 6, "batch_size": 3, **overrides})
    engine = FeatCalEngine(T5Family(), hp, "cpu", progress=False)
    report = engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    return merged, report


def test_trim_padding_drops_only_columns_that_are_padding_everywhere():
    padded = t5_batch([4, 2], [3, 1], pad_to=10, target_pad_to=8)
    trimmed = trim_padding(padded)
    assert trimmed["input_ids"].shape == (2, 4) and trimmed["labels"].shape == (2, 3)
    torch.testing.assert_close(trimmed["input_ids"], padded["input_ids"][:, :4])
    with pytest.raises(ValueError, match="no target tokens"):
        trim_padding({**padded, "labels": torch.full_like(padded["labels"], -100)})


def test_extra_padding_leaves_the_calibrated_weights_unchanged():
    """Padding enters no moment: the same examples with many more pad columns (not trimmed) give the
    same calibrated model, RMSNorm scales included."""
    results = []
    for pad_to, target_pad_to in ((0, 0), (25, 12)):
        base, experts, merged, data = tiny_t5_world(pad_to=pad_to, target_pad_to=target_pad_to)
        calibrated, _ = calibrate(merged, base, experts, data, calibrate_layernorm=True, accumulation_dtype="float64")
        results.append(calibrated.state_dict())
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-4, atol=1e-6, msg=name)


def _module_inputs(model, stack, index, names, batches):
    """Inputs of one block's modules over all batches from HF's own forward, valid tokens only:
    encoder tokens for encoder blocks and cross-attention k/v, target tokens for the decoder otherwise."""
    modules = dict(getattr(model, stack).block[index].named_modules())
    collected = {n: [] for n in names}
    masks = []
    handles = [
        modules[n].register_forward_pre_hook(lambda _m, args, n=n: collected[n].append(args[0].detach()))
        for n in names
    ]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
            masks.append(batch)
    for handle in handles:
        handle.remove()
    result = {}
    for name, tensors in collected.items():
        rows = []
        for x, batch in zip(tensors, masks):
            encoder_side = stack == "encoder" or name in CROSS_KV
            mask = batch["attention_mask"].bool() if encoder_side else batch["labels"] != -100
            rows.append(x[mask])
        result[name] = torch.cat(rows).double()
    return result


@pytest.mark.parametrize("stack,index", [("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1)])
def test_each_block_is_fitted_on_the_calibrated_prefix_encoder_first(stack, index):
    """Block l's weights equal an independent least-squares solve on the valid tokens that the *final* model
    feeds block l, with block l itself still merged: every decoder block therefore sees the calibrated encoder
    (and each expert its own encoder) through cross-attention. RMSNorm scales: the scale-only Eq. 57."""
    base, experts, merged, data = tiny_t5_world()
    original = copy.deepcopy(merged)
    lam, rho, alpha = 0.05, 2.0, 0.6
    calibrated, report = calibrate(
        merged, base, experts, data, lambda_=lam, rho=rho, alpha=alpha, calibrate_layernorm=True,
        accumulation_dtype="float64",
    )
    num_encoder = merged.config.num_layers
    assert all(m.startswith("encoder.block.") for b in report["blocks"][:num_encoder] for m in b["modules"])
    assert all(m.startswith("decoder.block.") for b in report["blocks"][num_encoder:] for m in b["modules"])

    def blk(model):
        return getattr(model, stack).block[index]

    snapshot = copy.deepcopy(calibrated)
    blk(snapshot).load_state_dict(blk(original).state_dict())
    linears = ENC_LINEARS if stack == "encoder" else DEC_LINEARS
    norms = [n for n, m in blk(original).named_modules() if type(m).__name__ == "T5LayerNorm"]
    tasks = list(experts)
    x_cal = {t: _module_inputs(snapshot, stack, index, linears + norms, data[t]) for t in tasks}
    x_exp = {t: _module_inputs(experts[t], stack, index, linears, data[t]) for t in tasks}
    mer, bas, got = (dict(blk(m).named_modules()) for m in (original, base, calibrated))
    for name in linears:
        w_exp = [dict(blk(experts[t]).named_modules())[name].weight for t in tasks]
        w_anc = rho * mer[name].weight + (1 - rho) * bas[name].weight
        weight, _ = independent_linear_solve(
            [x_cal[t][name] for t in tasks], [x_exp[t][name] for t in tasks], w_exp, None, w_anc, None, lam, alpha, 1e-8
        )
        torch.testing.assert_close(got[name].weight.double(), weight, rtol=1e-4, atol=1e-5, msg=f"{stack}.{index}.{name}")
    for name in norms:
        eps = mer[name].variance_epsilon
        gammas = [dict(blk(experts[t]).named_modules())[name].weight.double() for t in tasks]
        anchor = (rho * mer[name].weight + (1 - rho) * bas[name].weight).double()
        gamma = torch.empty_like(anchor)
        for k in range(anchor.numel()):  # per coordinate: sum_i mean_tokens (g z - g_i z)^2 + lam (g - anchor)^2
            rows_a, rows_b = [], []
            for t, g_i in zip(tasks, gammas):
                x = x_cal[t][name]
                z = x[:, k] / x.pow(2).mean(-1).add(eps).sqrt()
                s = (1.0 / z.shape[0]) ** 0.5
                rows_a.append(s * z[:, None])
                rows_b.append(s * g_i[k] * z[:, None])
            rows_a.append(torch.full((1, 1), lam**0.5, dtype=torch.float64))
            rows_b.append(lam**0.5 * anchor[k].reshape(1, 1))
            gamma[k] = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b)).solution[0, 0]
        torch.testing.assert_close(got[name].weight.double(), gamma, rtol=1e-4, atol=1e-5, msg=f"{stack}.{index}.{name}")


def test_norms_stay_merged_when_norm_calibration_is_off():
    base, experts, merged, data = tiny_t5_world()
    original = copy.deepcopy(merged)
    calibrated, report = calibrate(merged, base, experts, data, calibrate_layernorm=False)
    state = original.state_dict()
    for name, p in calibrated.named_parameters():
        if "layer_norm" in name or "relative_attention_bias" in name or "shared" in name or "lm_head" in name:
            torch.testing.assert_close(p, state[name], msg=name)
    assert not any("layer_norm" in m for b in report["blocks"] for m in b["modules"])
    drift = report["blocks"][-1]["drift"]
    assert all(d["after"]["l2"] < d["before"]["l2"] for d in drift.values())


def test_an_undefined_spearman_rho_is_named_in_the_average_not_averaged_as_nan():
    from featcal_fusionbench.evaluation.text_taskpool import average_report

    assert average_report({"glue-cola": 0.5, "glue-stsb": 0.25}) == {"score": 0.375}
    report = average_report({"glue-cola": 0.5, "glue-rte": 0.7, "glue-stsb": float("nan")})
    assert report["score"] is None
    assert report["score_of_defined"] == pytest.approx(0.6)
    assert "glue-stsb" in report["note"] and "other 2" in report["note"]


def test_a_merge_saved_by_fusionbenchs_seq2seq_pool_is_read_back_as_the_merged_model(tmp_path):
    """FusionBench 0.2.33's Seq2SeqLMPool saves ``merged_model_save_path`` as BaseModelPool does, one torch.save'd
    state dict file (no save_pretrained folder); ``method.merged_model_path`` reads that file, or a single
    .safetensors file, into the base's class. A state dict of another model is refused, naming the keys."""
    from fusion_bench.modelpool import BaseModelPool, Seq2SeqLMPool
    from safetensors.torch import save_file

    from featcal_fusionbench.integration.upstream import load_saved_model
    from helpers import perturbed, tiny_t5

    assert Seq2SeqLMPool.save_model is BaseModelPool.save_model  # the premise: if FusionBench overrides it, revisit
    base = tiny_t5(layers=2, d_model=32, vocab=300)
    merged = perturbed(base, 0.05, 1)
    Seq2SeqLMPool(models={}, tokenizer=None).save_model(merged, str(tmp_path / "merged"))
    assert (tmp_path / "merged").is_file()
    save_file({k: v.clone() for k, v in merged.state_dict().items()}, str(tmp_path / "merged.safetensors"))
    for path in (tmp_path / "merged", tmp_path / "merged.safetensors"):
        loaded = load_saved_model(str(path), base)
        assert type(loaded) is type(base) and loaded is not base
        assert all(torch.equal(v, merged.state_dict()[k]) for k, v in loaded.state_dict().items())
    other = tiny_t5(layers=1, d_model=32, vocab=300)
    torch.save(other.state_dict(), tmp_path / "other")
    mismatch = r"merged_model_path .*other' has different parameters from the pretrained model \(missing: \['encoder.bl"
    with pytest.raises(ValueError, match=mismatch):
        load_saved_model(str(tmp_path / "other"), base)
    torch.save(tiny_t5(layers=2, d_model=16, vocab=300).state_dict(), tmp_path / "narrow")  # the same names
    with pytest.raises(ValueError, match=r"narrow' has a different shape for shared.weight: \(300, 16\) where"):
        load_saved_model(str(tmp_path / "narrow"), base)
    (tmp_path / "text").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a state dict torch.load reads"):
        load_saved_model(str(tmp_path / "text"), base)


def test_the_output_site_is_the_greedy_generation_and_the_experts_probability_of_it():
    """auto_select's site on T5: the greedy output as FusionBench's text pool generates it (max_length 10), and an
    expert's probability of it, checked against HF's own paths: for the model's own output, the product of the
    normalised scores ``compute_transition_scores`` gives; for a hand-made output whose end-of-sequence token is
    followed by padding, exp(-(HF's per-example mean loss) x its token count) on the labels up to that end."""
    from featcal_fusionbench.families.t5 import GENERATION_MAX_LENGTH

    base, experts, _merged, data = tiny_t5_world()
    output, expert, batch = T5Family().output_site(), experts["task0"], data["task0"][0]
    generated = output.generate(expert, batch)
    assert generated.shape[1] <= GENERATION_MAX_LENGTH == 10
    again = expert.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_length=10,
                            do_sample=False, output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(again.sequences, generated)
    steps = expert.compute_transition_scores(again.sequences, again.scores, normalize_logits=True)
    ended = torch.cat([torch.zeros_like(generated[:, :1]), (generated[:, 1:-1] == 1).long().cumsum(-1)], -1) > 0
    own = torch.where(ended, 0.0, steps).sum(-1).exp()  # a finished row's padding is scored 0 by generate, kept out
    torch.testing.assert_close(output.probability(expert, batch, generated), own, rtol=1e-4, atol=1e-7)

    rows = batch["input_ids"].shape[0]
    made = torch.zeros(rows, 7, dtype=torch.long)  # start token, 2..4 tokens, end (1), then padding
    for i in range(rows):
        made[i, 1:3 + i] = torch.arange(5 + i, 7 + 2 * i)
        made[i, 3 + i] = 1
    got = output.probability(base, batch, made)
    for i in range(rows):
        labels = made[i:i + 1, 1:4 + i]
        loss = base(input_ids=batch["input_ids"][i:i + 1], attention_mask=batch["attention_mask"][i:i + 1],
                    labels=labels).loss
        torch.testing.assert_close(got[i], torch.exp(-loss * labels.shape[1]), rtol=1e-4, atol=1e-9)
    assert bool(((got > 0) & (got <= 1)).all())
