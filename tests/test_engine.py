"""The forward-order engine on tiny CLIP vision models: closed forms against an independent solve, and what is
CLIP-specific. What every family keeps is in test_family_contract.py."""

import copy
import dataclasses

import pytest
import torch

from featcal_fusionbench.core.block_sums import BlockSums
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.core.moments import NonFiniteError
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.engine.policy import FixedHParams
from featcal_fusionbench.engine.step import BlockStep
from featcal_fusionbench.families.clip_vision import CLIPVisionFamily

from helpers import (
    block_module_inputs,
    independent_layernorm_solve,
    independent_linear_solve,
    tiny_world,
)

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"]
NORMS = ["layer_norm1", "layer_norm2"]


def calibrate(merged, base, experts, data, family_options=None, track_upstream=False, **overrides):
    hp = FeatCalHParams(num_calibration_examples=12, batch_size=4, **overrides)
    engine = FeatCalEngine(
        CLIPVisionFamily(**(family_options or {})), hp, "cpu", progress=False, track_upstream=track_upstream
    )
    report = engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    return merged, report


def block(model, index):
    return model.vision_model.encoder.layers[index]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_each_block_is_fitted_on_inputs_from_the_calibrated_prefix(index):
    """Block l's solution equals an independent solve on the features the *final* model feeds
    block l (its prefix is the calibrated prefix), with block l itself still merged (App. F)."""
    base, experts, merged, data = tiny_world()
    original = copy.deepcopy(merged)
    lam, rho, alpha = 0.05, 2.0, 0.3
    calibrated, _ = calibrate(merged, base, experts, data, lambda_=lam, rho=rho, alpha=alpha, accumulation_dtype="float64")

    snapshot = copy.deepcopy(calibrated)  # calibrated prefix, uncalibrated block `index`
    block(snapshot, index).load_state_dict(block(original, index).state_dict())
    tasks = list(experts)
    x_cal = {t: block_module_inputs(snapshot, index, LINEARS + NORMS, data[t]) for t in tasks}
    x_exp = {t: block_module_inputs(experts[t], index, LINEARS, data[t]) for t in tasks}
    mods = {name: dict(block(m, index).named_modules()) for name, m in [("mer", original), ("base", base)]}
    for name in LINEARS:
        e_mods = [dict(block(experts[t], index).named_modules())[name] for t in tasks]
        w_anc = rho * mods["mer"][name].weight + (1 - rho) * mods["base"][name].weight
        b_anc = rho * mods["mer"][name].bias + (1 - rho) * mods["base"][name].bias
        weight, bias = independent_linear_solve(
            [x_cal[t][name] for t in tasks], [x_exp[t][name] for t in tasks],
            [m.weight for m in e_mods], [m.bias for m in e_mods], w_anc, b_anc, lam, alpha, 1e-8,
        )
        got = dict(block(calibrated, index).named_modules())[name]
        torch.testing.assert_close(got.weight.double(), weight, rtol=1e-4, atol=1e-5, msg=f"{name} weight")
        torch.testing.assert_close(got.bias.double(), bias, rtol=1e-4, atol=1e-5, msg=f"{name} bias")
    for name in NORMS:
        e_mods = [dict(block(experts[t], index).named_modules())[name] for t in tasks]
        m_mer, m_base = mods["mer"][name], mods["base"][name]
        gamma, beta = independent_layernorm_solve(
            [x_cal[t][name] for t in tasks], m_mer.eps,
            [m.weight for m in e_mods], [m.bias for m in e_mods],
            rho * m_mer.weight + (1 - rho) * m_base.weight, rho * m_mer.bias + (1 - rho) * m_base.bias, lam,
        )
        got = dict(block(calibrated, index).named_modules())[name]
        torch.testing.assert_close(got.weight.double(), gamma, rtol=1e-4, atol=1e-5, msg=f"{name} scale")
        torch.testing.assert_close(got.bias.double(), beta, rtol=1e-4, atol=1e-5, msg=f"{name} shift")


def test_calibration_reduces_drift_in_every_block():
    base, experts, merged, data = tiny_world()
    _, report = calibrate(merged, base, experts, data)
    for block_report in report["blocks"]:
        for task, drift in block_report["drift"].items():
            # the block's own effect: uncalibrated -> calibrated on the same calibrated prefix
            assert drift["after"]["l2"] < drift["before"]["l2"], (block_report["block"], task)
            assert "upstream" not in drift


def test_non_finite_expert_is_reported_with_the_module_name():
    base, experts, merged, data = tiny_world()
    with torch.no_grad():
        block(experts["task1"], 1).mlp.fc1.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"encoder\.layers\.1\.mlp\.fc2.*task1"):
        calibrate(merged, base, experts, data)


def test_last_block_patch_weight_changes_q_but_not_k_v():
    base, experts, merged, data = tiny_world()
    uniform, _ = calibrate(copy.deepcopy(merged), base, experts, data)
    demo, _ = calibrate(copy.deepcopy(merged), base, experts, data, family_options={"last_block_patch_token_weight": 0.01})
    last_u, last_d = block(uniform, 2).self_attn, block(demo, 2).self_attn
    torch.testing.assert_close(last_u.k_proj.weight, last_d.k_proj.weight)
    torch.testing.assert_close(last_u.v_proj.weight, last_d.v_proj.weight)
    assert not torch.allclose(last_u.q_proj.weight, last_d.q_proj.weight)
    # earlier blocks never see the weighting
    torch.testing.assert_close(block(uniform, 1).mlp.fc1.weight, block(demo, 1).mlp.fc1.weight)


def test_patch_token_weights_are_made_in_the_moments_dtype():
    from featcal_fusionbench.families.clip_vision import CLS_WEIGHTED

    family = CLIPVisionFamily(last_block_patch_token_weight=0.01)
    hidden = torch.zeros(2, 5, 4)
    for dtype in (torch.float32, torch.float64):
        weights = family.token_weights(CLS_WEIGHTED, hidden, None, dtype)
        expected = torch.full((2, 5), 0.01, dtype=dtype)
        expected[:, 0] = 1.0
        assert weights.dtype == dtype and torch.equal(weights, expected)  # float64: 0.01, not float32's 0.0099999998


def test_norm_right_hand_sides_are_built_in_float64_from_float32_moments():
    from types import SimpleNamespace

    from featcal_fusionbench.core.moments import NormInputStats

    g = torch.Generator().manual_seed(0)
    sums, reference = BlockSums(), {}
    for _ in range(3):  # tasks: the sums over them are float64 too
        stats = NormInputStats(mean=torch.randn(16, generator=g) * 30, second_moment=torch.rand(16, generator=g) * 900)
        site = SimpleNamespace(weight=torch.randn(16, generator=g), bias=torch.randn(16, generator=g))
        sums.add_norm("ln", stats, site)
        q, z = stats.second_moment.double(), stats.mean.double()
        gamma, beta = site.weight.double(), site.bias.double()
        for key, value in {"q": q, "z": z, "r_gamma": q * gamma + z * beta, "r_beta": z * gamma + beta}.items():
            reference[key] = reference[key] + value if key in reference else value
    for key, value in reference.items():
        assert sums.norm["ln"][key].dtype == torch.float64, key
        torch.testing.assert_close(sums.norm["ln"][key], value, rtol=0, atol=0, msg=key)


def test_statistics_memory_does_not_grow_with_the_number_of_examples():
    sizes = []
    for batches in (1, 4):
        base, experts, merged, data = tiny_world(batches=batches)
        hp = FeatCalHParams(num_calibration_examples=4 * batches, batch_size=4)
        engine = FeatCalEngine(CLIPVisionFamily(), hp, "cpu", progress=False)
        sizes.append(engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})["statistics_bytes"])
    assert sizes[0] == sizes[1] > 0


def test_the_block_solve_keeps_values_in_the_parameters_dtype_and_drops_each_solved_group(monkeypatch):
    solve = BlockStep.solve
    solved = []

    def checked(self, sums, hp, consume=False):
        assert consume  # the engine solves each block's sums once
        kept = solve(self, copy.deepcopy(sums), hp).updates
        solution = solve(self, sums, hp, consume=True)
        updates = solution.updates
        assert not (sums.gram or sums.mean_cal or sums.target or sums.bias_target)
        assert [(n, a) for n, a, _ in kept] == [(n, a) for n, a, _ in updates]
        for (name, attr, wide), (_, _, value) in zip(kept, updates):
            assert wide.dtype == torch.float64 and value.dtype == getattr(self.plan.sites[name], attr).dtype == torch.float32
            assert torch.equal(wide.to(value.dtype), value)
        solved.append(len(updates))
        return solution

    monkeypatch.setattr(BlockStep, "solve", checked)
    base, experts, merged, data = tiny_world()
    calibrate(merged, base, experts, data, calibrate_layernorm=True)
    assert len(solved) == len(merged.vision_model.encoder.layers) and min(solved) > 0


def test_upstream_trajectory_drift_is_reported_when_tracked_and_calibration_reduces_it():
    base, experts, merged, data = tiny_world()
    original = copy.deepcopy(merged)
    _, report = calibrate(merged, base, experts, data, track_upstream=True)
    last = report["blocks"][-1]["drift"]
    for task, drift in last.items():
        assert drift["after"]["l2"] < drift["upstream"]["l2"], task
    # the upstream trajectory is the merged model's own: compare with HF's forward of the original model
    with torch.no_grad():
        hidden = original(pixel_values=torch.cat(data["task0"]), output_hidden_states=True).hidden_states[-1]
        expert_hidden = experts["task0"](pixel_values=torch.cat(data["task0"]), output_hidden_states=True).hidden_states[-1]
    expected = (hidden - expert_hidden).norm(dim=-1).mean()
    assert abs(last["task0"]["upstream"]["l2"] - float(expected)) < 1e-4 * float(expected)


class RhoByDepth:
    """docs/architecture.md's example policy: rho grows with depth."""

    needs_parts = False

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks

    def check(self, num_blocks):
        assert num_blocks == self.num_blocks

    def for_block(self, index, hparams):
        return RhoChoice(hparams, 1.0 + index / self.num_blocks)


class RhoChoice:
    def __init__(self, hparams, rho):
        self.hp, self.sums = dataclasses.replace(hparams, rho=rho), BlockSums()
        self.report = {"rho": rho}

    def add_task(self, step, moments, expert_sites):
        step.fold(moments, expert_sites, self.sums, self.hp)

    def solve(self, step):
        return step.solve(self.sums, self.hp, consume=True)


def test_a_policy_of_ones_own_calibrates_like_the_same_values_as_a_schedule():
    """The public block step serves a policy written outside the package (docs/architecture.md's example): bit for
    bit what the built-in schedule of the same values gives, with the policy's report in each block's entry."""
    base, experts, merged, data = tiny_world()
    hp = FeatCalHParams(num_calibration_examples=12, batch_size=4)
    layers = len(merged.vision_model.encoder.layers)
    schedule = [dataclasses.replace(hp, rho=1.0 + i / layers) for i in range(layers)]
    reports, models = [], []
    for policy in (RhoByDepth(layers), FixedHParams(schedule)):
        model = copy.deepcopy(merged)
        engine = FeatCalEngine(CLIPVisionFamily(), hp, "cpu", progress=False, policy=policy)
        reports.append(engine.run(model, base, experts, {t: iter(v) for t, v in data.items()}))
        models.append(model)
    assert [b["rho"] for b in reports[0]["blocks"]] == [b["hparams"]["rho"] for b in reports[1]["blocks"]]
    assert reports[0]["blocks"][-1]["rho"] > reports[0]["blocks"][0]["rho"]
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(AssertionError):
        FeatCalEngine(CLIPVisionFamily(), hp, "cpu", progress=False, policy=RhoByDepth(layers + 1)).run(
            copy.deepcopy(merged), base, experts, {t: iter(v) for t, v in data.items()}
        )
