"""method.auto_select: label-free choice of lambda, rho and alpha (selection, autoselect)."""

import copy
import json
import math
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from featcal_fusionbench import FeatCalAlgorithm
from featcal_fusionbench.integration.algorithm import REPORT_NAME
from featcal_fusionbench.autoselect.search import auto_calibrate, describe_choice, fold_datasets
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.engine.step import LinearGroup
from featcal_fusionbench.families import LayerNormSite, LinearSite, family_for
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.core.moments import LinearInputMoments, NormInputMoments, layer_norm_without_affine
from featcal_fusionbench.core.objective import HeldoutObjective
from featcal_fusionbench.autoselect.options import PATCH_WEIGHT, SelectionOptions, candidate_key, with_candidate
from featcal_fusionbench.core.sampling import fold_of, heldout_split

from golden_cases import make_engine
from helpers import tiny_causal_lm_world, tiny_t5_world, tiny_world
from test_algorithm import SpyUpstream, load_pool, make

SMALL_GRID = {"lambda_": [1e-3, 0.05, 1.0], "rho": [1.0, 2.0], "alpha": [0.3, 0.6]}


# ---- the held-out split -------------------------------------------------------------------------------------------


def test_the_split_is_disjoint_covers_the_examples_and_is_fixed_by_seed_and_task():
    fit, held = heldout_split(40, 0.25, 7, "mnist")
    assert len(held) == 10 and set(fit).isdisjoint(held) and sorted(fit + held) == list(range(40))
    assert heldout_split(40, 0.25, 7, "mnist") == (fit, held)
    assert heldout_split(40, 0.25, 8, "mnist")[1] != held, "another seed, another split"
    assert heldout_split(40, 0.25, 7, "svhn")[1] != held, "tasks are split independently"


def test_the_folds_are_balanced_fixed_by_seed_and_task_and_the_same_on_any_number_of_devices():
    folds = fold_of(42, 4, 7, "mnist")
    assert sorted(folds.count(k) for k in range(4)) == [10, 10, 11, 11]
    assert fold_of(42, 4, 7, "mnist") == folds
    assert fold_of(42, 4, 8, "mnist") != folds and fold_of(42, 4, 7, "svhn") != folds
    data = {"mnist": list(range(42))}
    whole, sizes = fold_datasets(data, 4, 7)
    assert sizes["mnist"] == [folds.count(k) for k in range(4)]
    assert [list(p) for p in whole["mnist"]] == [[i for i in range(42) if folds[i] == k] for k in range(4)]
    shares = [fold_datasets(data, 4, 7, shard=(rank, 3))[0]["mnist"] for rank in range(3)]
    for k in range(4):  # each fold shared out: every device holds part of it, together all of it
        held = [list(share[k]) for share in shares]
        assert all(held) and sorted(sum(held, [])) == list(whole["mnist"][k])
    with pytest.raises(ValueError, match="cannot be shared by 11 devices"):
        fold_datasets(data, 4, 7, shard=(0, 11))


# ---- criterion (c) against an independent float64 computation ---------------------------------------------------


def _tokens(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("projected", [False, True])
def test_the_heldout_linear_objective_equals_the_mean_squared_error_to_the_expert_up_to_its_constant(projected):
    d, m = 6, 3 if projected else 8
    hp = FeatCalHParams(accumulation_dtype="float64")
    held, direct, near = HeldoutObjective(), 0.0, 0.0
    w, b = _tokens(m, d, 1), _tokens(1, m, 2)[0]
    w_near = w + 1e-3 * _tokens(m, d, 3)  # a neighbouring candidate: the choice reads differences this small
    for task in range(2):
        x_cal, x_exp = _tokens(50 + 10 * task, d, 10 + task), _tokens(50 + 10 * task, d, 20 + task)
        expert = LinearSite(torch.nn.Linear(d, m).double().requires_grad_(False))
        y = x_exp @ expert.weight.T + expert.bias
        moments = LinearInputMoments(d, torch.float64, "cpu", out_dims={"f": m} if projected else None)
        moments.update(x_cal, None if projected else x_exp, None, {"f": y} if projected else None)
        stats = moments.finalize()
        held.add_linear(0, LinearGroup(["f"], None), stats, {"f": expert}, hp)
        held.num_tasks += 1
        omega = 1.0 / float(torch.linalg.matrix_norm(x_cal.T @ x_cal / len(x_cal)))
        def term(candidate):
            residual = x_cal @ candidate.T + b - y
            return omega * ((residual**2).sum(1).mean() - (y**2).sum(1).mean())

        direct, near = direct + term(w), near + term(w_near)
    # the sums are stored in float32 (objective.STORE_DTYPE), the scores computed in float64
    assert held.linear("f", w, b) == pytest.approx(float(direct), rel=1e-7)
    difference = held.linear("f", w_near, b) - held.linear("f", w, b)
    assert difference == pytest.approx(float(near - direct), rel=1e-5)


def test_the_heldout_layernorm_objective_equals_the_mean_squared_error_to_the_experts_affine():
    d = 5
    held, direct = HeldoutObjective(), 0.0
    gamma, beta = _tokens(1, d, 3)[0], _tokens(1, d, 4)[0]
    for task in range(3):
        x = _tokens(40, d, 30 + task)
        ln = torch.nn.LayerNorm(d).double()
        with torch.no_grad():
            ln.weight.copy_(_tokens(1, d, 40 + task)[0]), ln.bias.copy_(_tokens(1, d, 50 + task)[0])
        site = LayerNormSite(ln)
        moments = NormInputMoments(d, layer_norm_without_affine((d,), ln.eps), torch.float64, "cpu")
        moments.update(x, None)
        held.add_norm("ln", moments.finalize(), site)
        held.num_tasks += 1
        z = F.layer_norm(x, (d,), eps=ln.eps)
        direct += (((gamma * z + beta) - ln(x)) ** 2).sum(1).mean()
    assert held.normalization("ln", gamma, beta) == pytest.approx(float(direct), rel=1e-10)


# ---- options fail early ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, message",
    [
        ({"criterion": "accuracy"}, "criterion must be one of"),
        ({"folds": 1}, "folds must be auto or an integer >= 2"),
        ({"folds": "eight"}, "folds must be auto or an integer >= 2"),
        ({"noise_z": -1}, "noise_z must be a number >= 0"),
        ({"widen": "yes"}, "widen must be true or false"),
        ({"least_shrinkage": 1}, "least_shrinkage must be true or false"),
        ({"heldout_fraction": 0.0}, "heldout_fraction must lie strictly between 0 and 1"),
        ({"heldout_fraction": 1.0}, "heldout_fraction must lie strictly between 0 and 1"),
        ({"grid": {"lambda_": []}}, r"grid.lambda_ is empty"),
        ({"grid": {"lambda_": [0.0, 1.0]}}, r"grid.lambda_ values must be > 0"),
        ({"grid": {"beta": [1.0]}}, "grid has unknown key 'beta'"),
        ({"grid": {"alpha": [1.5]}}, r"grid.alpha values must lie in \[0, 1\]"),
        ({"search": "random"}, "search must be one of"),
        ({"grid": {"last_block_patch_token_weight": [1.0, 0.01]}}, "criterion 'objective' .* cannot vary"),
        ({"heldout": 0.2}, r"unknown option\(s\) \['heldout'\]"),
        ({"alpha_criterion": "agreement"}, r"alpha_criterion must be one of \['none', 'drift', 'site'\]"),
        ({"criterion": "drift", "alpha_criterion": "drift"}, "alpha_criterion 'drift' chooses alpha for criterion "
                                                             "'objective'; criterion 'drift' searches grid.alpha"),
        ({"criterion": "site", "site_parts": 4}, r"site_parts must be null .*, auto .* or 1 .*got 4"),
        ({"site_parts": "auto"}, "site_parts is given \\('auto'\\) but neither criterion nor alpha_criterion is 'site'"),
        ({"criterion": "site", "keep_method_lambda": "yes"}, "keep_method_lambda must be true or false"),
        ({"keep_method_lambda": True}, "keep_method_lambda is a rule of criterion 'site' .* criterion is 'objective'"),
        ({"criterion": "site", "few_examples": "warn"}, r"few_examples must be one of \['objective', 'site'\]"),
        ({"few_examples": "site"}, "few_examples 'site' is a rule of criterion 'site' .* criterion is 'objective'"),
        ("yes", "expected true, false or a mapping"),
    ],
)
def test_bad_auto_select_options_fail_at_construction(value, message):
    with pytest.raises(ValueError, match=f"invalid method.auto_select: .*{message}"):
        FeatCalAlgorithm(auto_select=value)


@pytest.mark.parametrize("auto_select, n, message", [
    ({"folds": 20}, 16, r"16 calibration example\(s\) in 20 folds leave a fold of 0"),
    ({"criterion": "drift", "heldout_fraction": 0.01}, 16, r"cannot be split into a fit and a held-out part .*0.01"),
    (True, 3, r"3 calibration example\(s\) in 4 folds leave a fold of 0"),  # auto: four below eight examples
    ({"alpha_criterion": "drift"}, 4, r"3 calibration example\(s\) in 4 folds leave a fold of 0"),  # the fit part's
    ({"alpha_criterion": "site", "folds": 2}, 3, r"'site' holds out each of 4 parts .*: 3 example\(s\) leave a part "
                                                 r"of 0, fewer than one per device \(1\); raise num_calibration_examples "
                                                 r"to 4"),  # its quarters in turn
    ({"criterion": "site", "search": "grid", "site_parts": "auto"}, 3,
     r"criterion 'site' holds out each of 4 parts .*: 3 example\(s\) leave a part of 0"),
    ({"criterion": "site", "search": "grid", "heldout_fraction": 0.01}, 16,
     r"cannot be split into a fit and a held-out part .*0.01"),  # its one held-out part
    ({"criterion": "site", "search": "grid", "heldout_fraction": 0.5}, 2,
     r"criterion site with 2 examples per task may fall back to criterion objective .*2 calibration example\(s\) in 4 "
     r"folds leave a fold of 0.*set auto_select.few_examples=site"),  # its split holds, the fallback's folds do not
])
def test_too_few_examples_to_split_fail_before_the_upstream_runs(auto_select, n, message, toy_world, tmp_path):
    spy = SpyUpstream()
    with pytest.raises(ValueError, match=message):
        make(tmp_path, upstream=spy, auto_select=auto_select, num_calibration_examples=n).run(load_pool(toy_world))
    assert not spy.ran


# ---- the search on tiny models -----------------------------------------------------------------------------------


def _datasets(world):
    return {t: [x for batch in batches for x in batch] for t, batches in world[3].items()}


def _batches_of(dataset):
    rows = [dataset[i] for i in range(len(dataset))]
    if isinstance(rows[0], Mapping):
        return [{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]} for i in range(0, len(rows), 4)]
    return [torch.stack(rows[i:i + 4]) for i in range(0, len(rows), 4)]


def _search(world, criterion, seed=0, hparams=FeatCalHParams(), **extra):
    base, experts, merged, data = world
    datasets, batches_of = _datasets(world), _batches_of
    options = SelectionOptions.parse({"criterion": criterion, "seed": seed, "grid": SMALL_GRID, **extra})

    model = copy.deepcopy(merged)
    report = auto_calibrate(make_engine, lambda o: family_for(base, o), options, hparams, model, base,
                            experts, datasets, batches_of, torch.device("cpu"))
    return model, report


def test_folds_auto_are_eight_for_a_few_examples_per_task_and_four_for_many():
    """The fit parts see (K - 1) / K of a task's examples; with few examples eight parts, above FEW_EXAMPLES four
    (half the per-part sums' memory). The report gives the number used."""
    from featcal_fusionbench.autoselect.options import FEW_EXAMPLES

    auto = SelectionOptions()
    assert auto.folds == "auto"
    assert [auto.folds_for(n) for n in (4, 7, 8, FEW_EXAMPLES, FEW_EXAMPLES + 1, 256)] == [4, 4, 8, 8, 4, 4]
    assert SelectionOptions(folds=5).folds_for(8) == SelectionOptions(folds=5).folds_for(256) == 5
    # every size four parts could share out still runs on one device; two devices need two examples a part
    for n in (4, 7, 8, 64, 65):
        auto.check_fold_sizes(n, 1, ["mnist"])
    auto.check_fold_sizes(16, 2, ["mnist"])
    SelectionOptions(folds=4).check_fold_sizes(12, 2, ["mnist"])
    with pytest.raises(ValueError, match=r"'mnist': 12 calibration example\(s\) in 8 folds leave a fold of 1, fewer "
                                         r"than one per device \(2\).*\(auto_select.folds is auto: 8 parts from 8 to "
                                         r"64 examples per task; auto_select.folds=4 makes them twice the size\)"):
        auto.check_fold_sizes(12, 2, ["mnist"])
    world = tiny_world(batches=4)  # 16 examples per task
    few = _search(world, "objective", hparams=FeatCalHParams(num_calibration_examples=16))[1]["auto_select"]
    assert few["folds"] == 8 and few["folds_per_task"]["task0"] == [2] * 8
    assert all(block["folds"] == 8 for block in few["blocks"])
    many = _search(world, "objective")[1]["auto_select"]  # the method's 256 examples per task
    assert many["folds"] == 4 and many["folds_per_task"]["task0"] == [4] * 4


def _rows(world):
    """The tiny world's batches as rows (one example each), so that the split picks examples."""
    base, experts, merged, data = world
    rows = {}
    for task, batches in data.items():
        if isinstance(batches[0], Mapping):
            rows[task] = [[{k: v[i] for k, v in b.items()} for i in range(len(b["input_ids"]))] for b in batches]
        else:
            rows[task] = batches
    return base, experts, merged, rows


@pytest.mark.parametrize("criterion", ["objective", "drift"])
def test_a_seeded_search_chooses_the_same_values_twice(criterion):
    world = tiny_world(batches=4)
    first_model, first = _search(world, criterion)
    second_model, second = _search(world, criterion)
    assert first["auto_select"]["choice"] == second["auto_select"]["choice"]
    for p, q in zip(first_model.parameters(), second_model.parameters()):
        assert torch.equal(p, q)
    other = _search(world, criterion, seed=1)[1]["auto_select"]
    key = "folds_per_task" if criterion == "objective" else "split"
    assert other[key] == first["auto_select"][key], "sizes depend on the fraction (or the folds) alone"


def test_the_objective_cross_fits_one_calibration_and_reports_each_blocks_choice_and_its_margin():
    """Coordinate search per block: lambda at the method's rho and alpha (its grid widened past a winning edge),
    then rho x alpha at that lambda; each candidate's score the sum over the four folds held out in turn. The
    block's choice is the best unless the method's values score within noise_z standard errors of it; its
    runner-up, margin (absolute, relative to the block's held-out gain, in standard errors) and edges are reported,
    and the final calibration runs the chosen schedule."""
    _, report = _search(tiny_world(batches=4), "objective", noise_z=0.0)
    auto = report["auto_select"]
    assert auto["calibrations"] == 1 and auto["search"] == "per_block (coordinate)" and auto["folds"] == 4
    assert auto["grid"]["alpha"] == [0.3, 0.6] and auto["folds_per_task"]["task0"] == [4, 4, 4, 4]
    assert len(auto["blocks"]) == report["num_blocks"] == 3
    for block in auto["blocks"]:
        scores = block["scores"]
        lambdas = {float(k.split(",")[0].split("=")[1]) for k in scores if "rho=2,alpha=0.3" in k}
        assert {1e-3, 0.05, 1.0} <= lambdas
        best_lambda = block["chosen"].split(",")[0]
        assert {f"{best_lambda},rho={r:g},alpha={a:g}" for r in (1.0, 2.0) for a in (0.3, 0.6)} <= set(scores)
        assert block["chosen"] == min(scores, key=scores.get), "noise_z 0: the best"
        runner = min((k for k in scores if k != block["chosen"]), key=scores.get)
        assert block["runner_up"] == runner
        assert block["margin"] == pytest.approx(scores[runner] - scores[block["chosen"]])
        assert block["margin"] >= 0 and block["heldout_gain"] > 0
        assert block["margin_relative"] == pytest.approx(block["margin"] / block["heldout_gain"])
        if float(best_lambda.split("=")[1]) < 1e-3:
            assert block["widened"]["lambda_"][0] == 1e-4, "the low edge won: widened a decade at a time"
    assert [entry["hparams"] for entry in report["blocks"]] == [
        dict(zip(("lambda_", "rho", "alpha"), (float(v.split("=")[1]) for v in key.split(","))))
        for key in auto["choice"]["per_block"]
    ], "the final calibration runs the chosen schedule"
    assert auto["cost_multiple"] > 0 and auto["search_seconds"] > 0
    assert "in block" in describe_choice(auto) and "standard errors behind" in describe_choice(auto)
    assert "not searched" not in describe_choice(auto), "a grid of alphas was searched"


def test_the_methods_values_are_kept_unless_the_evidence_beats_them_by_more_than_its_noise():
    """The method's values (lambda 0.05) off the grid: a noise_z no evidence can pass keeps them in every block,
    and the report says so; with noise_z 0 the grid's best is taken."""
    grid = {"lambda_": [1e-4, 1e-2, 1.0], "rho": [1.0, 2.0], "alpha": [0.3]}
    _, report = _search(tiny_world(batches=4), "objective", noise_z=1e9, grid=grid)
    auto = report["auto_select"]
    assert set(auto["choice"]["per_block"]) == {"lambda_=0.05,rho=2,alpha=0.3"}
    assert all(b["kept"] == "method" for b in auto["blocks"])
    assert "the method's values kept within the noise in block(s) 0-2" in describe_choice(auto)
    line = describe_choice(auto)
    assert "alpha the method's, not searched" in line and "featcal/auto_clip_site" in line
    _, report = _search(tiny_world(batches=4), "objective", noise_z=0.0, grid=grid)
    assert "lambda_=0.05,rho=2,alpha=0.3" not in report["auto_select"]["choice"]["per_block"]


def test_the_paired_difference_and_its_standard_error_match_an_independent_computation():
    import numpy as np

    from featcal_fusionbench.core.meters import paired_difference

    rng = np.random.default_rng(0)
    first = {"a": rng.normal(size=7), "b": rng.normal(size=3)}
    second = {t: v + rng.normal(0.1, 0.2, size=v.size) for t, v in first.items()}
    mean, se = paired_difference({t: torch.tensor(v) for t, v in first.items()},
                                 {t: torch.tensor(v) for t, v in second.items()})
    differences = [first[t] - second[t] for t in first]
    assert mean == pytest.approx(np.mean([d.mean() for d in differences]))
    assert se == pytest.approx(np.sqrt(sum(d.var(ddof=1) / d.size for d in differences)) / 2)
    one = {"a": torch.tensor([1.0])}
    assert paired_difference(one, {"a": torch.tensor([0.0])}) == (1.0, float("inf")), "one example: no evidence"


ALPHA_GRID = {"lambda_": [1e-3, 1.0], "rho": [2.0], "alpha": [0.15, 0.6]}


def test_the_alpha_stage_scores_each_alpha_by_held_out_drift_and_the_pass_runs_with_the_choice():
    """alpha_criterion drift: lambda and rho chosen per block on the fit part at the method's alpha, then every
    alpha of the grid and the method's calibrated on the fit part with that schedule and scored by the mean cosine
    of the last block's output to the expert's on the held-out part (recomputed here with the engine and the drift
    meter); with noise_z 0 the best alpha is taken, and the per-block pass then chooses lambda and rho at it."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.search import final_states, split_datasets
    from featcal_fusionbench.core.meters import DriftMeter
    from featcal_fusionbench.engine.policy import FixedHParams

    world = tiny_world(batches=4)
    base, experts, merged, _ = world
    _, report = _search(world, "objective", alpha_criterion="drift", noise_z=0.0, widen=False, grid=ALPHA_GRID)
    auto = report["auto_select"]
    stage = auto["alpha"]
    assert auto["alpha_criterion"] == "drift" and auto["grid"]["alpha"] == [0.15, 0.3, 0.6]
    assert set(stage["scores"]) == {"0.15", "0.3", "0.6"} and stage["method_alpha"] == 0.3
    assert stage["split"]["task0"] == {"fit": 12, "heldout": 4} and stage["calibrations"] == 3
    assert auto["calibrations"] == 1 + 3
    assert stage["best"] == max((float(k) for k in stage["scores"]), key=lambda a: stage["scores"][f"{a:g}"])
    assert stage["chosen"] == stage["best"] and not stage["kept"]
    assert {key.split(",")[2] for key in auto["choice"]["per_block"]} == {f"alpha={stage['chosen']:g}"}
    fit, held, _ = split_datasets(_datasets(world), SelectionOptions(), 0)
    family = family_for(base)
    schedule = [replace(FeatCalHParams(), **h) for h in stage["schedule"]]
    for alpha in (0.6,):
        model = copy.deepcopy(merged)
        FeatCalEngine(family, FeatCalHParams(), "cpu", progress=False,
                      policy=FixedHParams([replace(h, alpha=alpha) for h in schedule])).run(
            model, base, experts, {t: [b for p in fold_datasets(fit, 8, 0)[0][t] for b in _batches_of(p)] for t in fit})
        per_task = []
        for task in experts:
            meter = DriftMeter()
            for (h, _m), (r, _n) in zip(final_states(family, model, _batches_of(held[task]), "cpu"),
                                        final_states(family, experts[task], _batches_of(held[task]), "cpu")):
                meter.update(h, r)
            per_task.append(meter.result()["cosine"])
        assert stage["scores"][f"{alpha:g}"] == pytest.approx(sum(per_task) / len(per_task), rel=1e-5)
    assert "by held-out drift" in describe_choice(auto) or "the method's, the closest" in describe_choice(auto)


class _ProjectedSite:
    """CLIP's feature site (the pooled output through a projection, unit-normalised) without a pool to read the
    projection from."""

    one_row_per_example = True

    def __init__(self, hidden: int = 32, dim: int = 8):
        self.projection = torch.nn.Linear(hidden, dim, bias=False)
        torch.nn.init.normal_(self.projection.weight, generator=torch.Generator().manual_seed(5))

    def to(self, device):
        self.projection.to(device)
        return self

    def features(self, model, images):
        return F.normalize(self.projection(model(images)[1]), dim=-1)


@pytest.mark.parametrize("batches, folds", [(4, 4), (17, 1)], ids=["16 examples: quarters in turn", "68: one quarter"])
def test_the_alpha_stage_by_the_feature_site_scores_each_alpha_by_the_held_out_rows_cosine(batches, folds):
    """alpha_criterion site: the fit part calibrated once per alpha at or above the method's, with the grid's
    smallest lambda and the method's rho, each scored by the mean over tasks of the per-example cosine of its
    held-out features at the family's feature site to the expert's (recomputed here with the engine and the site);
    up to FEW_EXAMPLES examples per task each quarter is held out in turn, above one quarter; alphas below the
    method's are not tried; with noise_z 0 the best is taken."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.search import AlphaSite, split_datasets

    world = tiny_world(batches=batches)
    base, experts, merged, _ = world
    datasets = _datasets(world)
    grid = {"lambda_": [1e-3, 1.0], "rho": [2.0], "alpha": [0.15, 0.45, 0.6]}
    options = SelectionOptions.parse({"criterion": "objective", "seed": 0, "grid": grid, "noise_z": 0.0,
                                      "widen": False, "alpha_criterion": "site"})

    with pytest.raises(ValueError, match="alpha_criterion 'site' needs the family's feature site"):
        auto_calibrate(make_engine, lambda o: family_for(base, o), options, FeatCalHParams(), copy.deepcopy(merged),
                       base, experts, datasets, _batches_of, torch.device("cpu"))
    site = _ProjectedSite()
    report = auto_calibrate(make_engine, lambda o: family_for(base, o), options, FeatCalHParams(), copy.deepcopy(merged),
                            base, experts, datasets, _batches_of, torch.device("cpu"), site=AlphaSite(site))
    auto = report["auto_select"]
    stage = auto["alpha"]
    assert auto["alpha_criterion"] == "site" and stage["criterion"] == "site"
    assert stage["folds"] == folds and stage["calibrations"] == 3 * folds
    assert set(stage["scores"]) == {"0.3", "0.45", "0.6"}
    assert stage["stage_hparams"] == {"lambda_": 1e-3, "rho": FeatCalHParams().rho}
    assert stage["best"] == max((float(k) for k in stage["scores"]), key=lambda a: stage["scores"][f"{a:g}"])
    assert stage["chosen"] == stage["best"]
    assert {key.split(",")[2] for key in auto["choice"]["per_block"]} == {f"alpha={stage['chosen']:g}"}
    if folds == 1:
        fit, held, _ = split_datasets(datasets, SelectionOptions(), 0)
        splits = [(fit, held)]
    else:
        parts = fold_datasets(datasets, folds, 0)[0]
        splits = [({t: [x for j, p in enumerate(ps) if j != k for x in p] for t, ps in parts.items()},
                   {t: ps[k] for t, ps in parts.items()}) for k in range(folds)]
    family = family_for(base)
    for alpha in (0.3, 0.45, 0.6):
        cosines = {t: [] for t in experts}
        for fit, held in splits:
            model = copy.deepcopy(merged)
            FeatCalEngine(family, replace(FeatCalHParams(), lambda_=1e-3, alpha=alpha), "cpu", progress=False).run(
                model, base, experts, {t: _batches_of(fit[t]) for t in fit})
            with torch.no_grad():
                for t in experts:
                    cosines[t].append(F.cosine_similarity(
                        torch.cat([site.features(model, b) for b in _batches_of(held[t])]),
                        torch.cat([site.features(experts[t], b) for b in _batches_of(held[t])]), dim=-1))
        per_task = [float(torch.cat(c).mean()) for c in cosines.values()]
        if folds > 1:  # every example held out once
            assert all(sum(len(x) for x in c) == len(datasets[t]) for t, c in cosines.items())
        assert stage["scores"][f"{alpha:g}"] == pytest.approx(sum(per_task) / len(per_task), rel=1e-5)
    assert "the held-out feature site's cosine" in describe_choice(auto)


def _t5_rows(world):
    """Each task's examples of a tiny T5 world padded to one width, one dict per example."""
    return {t: [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]
            for t, batches in world[3].items()}


def test_site_on_t5_scores_the_experts_probability_of_each_held_out_generation(caplog):
    """On T5 (a row per target token at its feature site) ``site`` reads what the text task pool scores: per
    held-out example, the probability the task's expert gives the calibrated copy's greedy output, recomputed here
    with HF's own loss on each generation (each half of 12 examples per task held out in turn). The alpha stage
    scores the alphas at or above the method's; criterion site, given the same lambda, rho and split, scores each
    alpha as the stage does."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.search import ExpertProbability, alpha_site, choose_alpha

    world = tiny_t5_world(batches=4, pad_to=12, target_pad_to=8)
    base, experts, merged, _ = world
    datasets = _t5_rows(world)
    family = family_for(base)
    site = alpha_site(family, None, base)
    assert isinstance(site, ExpertProbability)
    hp = FeatCalHParams(alpha=0.6)
    common = {"seed": 0, "noise_z": 0.0, "heldout_fraction": 0.5, "site_parts": "all"}

    options = SelectionOptions.parse({**common, "alpha_criterion": "site", "grid": {"alpha": [0.3, 0.6, 1.0]}})
    stage = choose_alpha(make_engine, family, options, hp, {"lambda_": (1e-3,), "rho": (2.0,), "alpha": (0.3, 0.6, 1.0)},
                         merged, base, experts, datasets, _batches_of, torch.device("cpu"), 0, site=site)
    assert stage["measure"] == "the experts' probability of the held-out generations"
    assert set(stage["scores"]) == {"0.6", "1"} and stage["folds"] == 2  # none below the method's
    output = family.output_site()
    parts = fold_datasets(datasets, 2, 0)[0]
    probability = {t: [] for t in experts}
    for k in range(2):
        model = copy.deepcopy(merged)
        FeatCalEngine(family, replace(hp, lambda_=1e-3, alpha=1.0), "cpu", progress=False).run(
            model, base, experts, {t: _batches_of(ps[1 - k]) for t, ps in parts.items()})
        with torch.no_grad():
            for t, expert in experts.items():
                for batch in _batches_of(parts[t][k]):
                    for i, out in enumerate(output.generate(model, batch)):
                        ended = (out[1:] == 1).nonzero()
                        labels = out[1:][: int(ended[0]) + 1 if len(ended) else None][None]
                        loss = expert(input_ids=batch["input_ids"][i:i + 1],
                                      attention_mask=batch["attention_mask"][i:i + 1], labels=labels).loss
                        probability[t].append(float(torch.exp(-loss * labels.shape[1])))
    expected = sum(sum(v) / len(v) for v in probability.values()) / len(probability)
    assert stage["scores"]["1"] == pytest.approx(expected, rel=1e-4)

    options = SelectionOptions.parse({**common, "criterion": "site", "few_examples": "site",
                                      "grid": {"lambda_": [1e-3], "rho": [2.0], "alpha": [0.6, 1.0]}})
    few = replace(hp, num_calibration_examples=12)  # the tiny world's: below where this measure was measured to hold
    with caplog.at_level("WARNING", logger="featcal_fusionbench.autoselect.search"):
        auto = auto_calibrate(make_engine, lambda o: family_for(base, o), options, few, copy.deepcopy(merged), base,
                              experts, datasets, _batches_of, torch.device("cpu"), site=site)["auto_select"]
    assert ("criterion site with 12 calibration examples per task: below 256 it was not measured to beat criterion "
            "objective" in caplog.text and "featcal/auto_flan_t5_ta" in caplog.text and "it runs anyway" in caplog.text)
    assert {k.split(",")[2]: c["score"] for k, c in auto["candidates"].items()} == pytest.approx(
        {f"alpha={a}": v for a, v in stage["scores"].items()}, rel=1e-6)
    assert auto["alpha"]["measure"] == stage["measure"] and stage["measure"] in describe_choice(auto)


class _SymbolTokenizer:
    """A stand-in tokenizer for the tiny T5 (vocabulary 64): HF's ``batch_decode(sequences,
    skip_special_tokens=True)`` contract, padding (0) and the end (1) dropped, every other id one symbol: a digit
    (ten ids a digit each, so that a number task's texts tie) or, with ``letters``, a letter."""

    def __init__(self, letters=False):
        self.symbols = "abcdefghijklmnopqrstuvwxyz" if letters else "0123456789"

    def batch_decode(self, sequences, skip_special_tokens=False):
        return ["".join(self.symbols[int(i) % len(self.symbols)] for i in row
                        if not (skip_special_tokens and int(i) in (0, 1))) for row in sequences]


def test_site_on_t5_scores_a_task_whose_expert_writes_numbers_by_its_share_of_spearmans_rho():
    """A task whose expert's held-out outputs parse as numbers is scored as FusionBench scores STS-B: each example's
    share of Spearman's rho (scipy's, computed here on the decoded texts) between the model's numbers and the
    expert's; with words (or no tokenizer) the expert's probability of the output, as before. Outputs of one token
    (one digit: twelve examples tie). The pool's tokenizer config is what the site decodes with."""
    from fusion_bench.modelpool import Seq2SeqLMPool
    from scipy.stats import spearmanr
    from transformers import ByT5Tokenizer

    from featcal_fusionbench.autoselect.search import ExpertProbability, alpha_site
    from featcal_fusionbench.families.t5 import T5GreedyOutput

    base, experts, merged, data = tiny_t5_world(batches=4, pad_to=12, target_pad_to=8)
    family = family_for(base)
    held = data.__getitem__

    def scored(tokenizer):
        site = ExpertProbability(T5GreedyOutput(tokenizer, max_length=2)).hold_out(family, experts, held,
                                                                                  torch.device("cpu"))
        return site, site.example_scores(family, merged, held)

    site, numbers = scored(_SymbolTokenizer())
    assert site.measure == ("the experts' probability of the held-out generations (Spearman's rho with the "
                            "expert's numbers on task0, task1)")
    tokenizer, output = _SymbolTokenizer(), T5GreedyOutput(max_length=2)
    for task, expert in experts.items():
        texts = {name: [t for b in data[task] for t in tokenizer.batch_decode(output.generate(m, b), True)]
                 for name, m in (("merged", merged), ("expert", expert))}
        rho = spearmanr(*[[float(t) if t else 0.0 for t in texts[k]] for k in ("merged", "expert")])[0]
        assert not math.isnan(rho) and len(set(texts["expert"])) < len(texts["expert"])  # ranked, with ties
        assert float(numbers[task].mean()) == pytest.approx(rho, rel=1e-6, abs=1e-9)
    plain, probability = scored(None)
    words, worded = scored(_SymbolTokenizer(letters=True))
    assert words.measure == plain.measure == "the experts' probability of the held-out generations"
    for task in experts:
        torch.testing.assert_close(worded[task], probability[task])
    assert float(max(abs(numbers[t].mean() - probability[t].mean()) for t in experts)) > 1e-3
    pool = Seq2SeqLMPool({"_pretrained_": base}, tokenizer={"_target_": "transformers.ByT5Tokenizer"})
    assert isinstance(alpha_site(family, pool, base).output.tokenizer, ByT5Tokenizer)


def test_a_number_task_is_one_whose_expert_writes_numbers_more_than_half_the_time():
    from featcal_fusionbench.autoselect.search import as_numbers, writes_numbers

    torch.testing.assert_close(as_numbers(["3.8", " 4 ", "yes", "inf", "nan"]),
                               torch.tensor([3.8, 4.0, math.nan, math.nan, math.nan], dtype=torch.float64),
                               equal_nan=True)
    assert [writes_numbers(as_numbers(t)) for t in (["3.8", "1", "no"], ["3.8", "no"], ["yes", "no"], [])] == [
        True, False, False, False]


def test_rank_agreement_is_each_examples_share_of_spearmans_rho():
    from scipy.stats import spearmanr

    from featcal_fusionbench.core.meters import rank_agreement

    generator = torch.Generator().manual_seed(0)
    for size, values in ((40, 6), (7, 100), (3, 50)):
        a, b = (torch.randint(0, values, (size,), generator=generator).double() for _ in range(2))
        expected = spearmanr(a, b)[0]
        got = rank_agreement(a, b)
        assert got.shape == (size,)
        assert float(got.mean()) == (0.0 if math.isnan(expected) else pytest.approx(expected, abs=1e-12))
    assert torch.equal(rank_agreement(torch.ones(5), torch.arange(5.0)), torch.zeros(5, dtype=torch.float64))


def test_site_parts_all_holds_out_each_part_in_turn_at_any_number_of_examples():
    parts = {"alpha": lambda **o: SelectionOptions.parse({"alpha_criterion": "site", **o}).site_folds,
             "site": lambda **o: SelectionOptions.parse({"criterion": "site", **o}).site_folds}
    assert [parts["alpha"]()(n) for n in (32, 64, 65, 256)] == [4, 4, 1, 1]  # auto, alpha_criterion's default
    assert [parts["alpha"](site_parts="all")(n) for n in (32, 256)] == [4, 4]
    assert [parts["site"]()(n) for n in (32, 256)] == [1, 1]
    assert parts["site"](site_parts="all", heldout_fraction=0.125)(256) == 8


def test_the_alpha_stage_by_the_feature_site_needs_one_row_per_example_and_a_pool_with_the_projection():
    from featcal_fusionbench.autoselect.search import alpha_site

    base, _experts, _merged, _data = tiny_causal_lm_world("llama")
    with pytest.raises(ValueError, match="'site' \\(criterion or alpha_criterion\\) compares one feature row per "
                                         "example .* causal_lm family's site has one row per token"):
        alpha_site(family_for(base), None, base)
    clip = tiny_world()[0]
    with pytest.raises(ValueError, match="'site' \\(criterion or alpha_criterion\\) reads the family's feature site: "
                                         ".*need a CLIPVisionModelPool"):
        alpha_site(family_for(clip), None, clip)


def test_the_alpha_stage_by_the_feature_site_runs_in_the_method_on_a_clip_pool(toy_world, tmp_path):
    make(tmp_path, auto_select={"alpha_criterion": "site", "widen": False,
                                "grid": {"lambda_": [1e-3], "rho": [2.0], "alpha": [0.15, 0.6]}}).run(load_pool(toy_world))
    auto = json.loads(next(tmp_path.rglob(REPORT_NAME)).read_text())["auto_select"]
    assert auto["alpha"]["criterion"] == "site" and set(auto["alpha"]["scores"]) == {"0.3", "0.6"}
    assert {key.split(",")[2] for key in auto["choice"]["per_block"]} == {f"alpha={auto['alpha']['chosen']:g}"}


@pytest.mark.parametrize("site_parts", [None, "auto"])
def test_criterion_site_scores_every_lambda_alpha_point_at_the_feature_site_and_calibrates_the_best(caplog, site_parts):
    """criterion site: a copy of the merged model calibrated on the fit part per (lambda, alpha) of its grid (by
    default SITE_LAMBDAS x the method's alpha and the candidates above it, at the method's rho), each scored by the
    mean over tasks of its held-out rows' cosine to the expert's (recomputed here with the engine and the site); the
    best point is then calibrated on every example, bit for bit an ordinary calibration with those values. By
    default one quarter is held out; ``site_parts: auto`` holds out each quarter in turn (16 examples per task, up
    to 64) and pools every example's cosine."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.options import SITE_LAMBDAS
    from featcal_fusionbench.autoselect.search import AlphaSite, split_datasets

    world = tiny_world(batches=4)
    base, experts, merged, _ = world
    datasets = _datasets(world)
    options = SelectionOptions.parse({"criterion": "site", "search": "grid", "seed": 0})
    hp = FeatCalHParams()
    assert options.grid_for({}, hp) == {"lambda_": SITE_LAMBDAS, "rho": (hp.rho,), "alpha": (0.3, 0.45, 0.6)}
    options = SelectionOptions.parse({"criterion": "site", "search": "grid", "seed": 0, "site_parts": site_parts,
                                      "few_examples": "site", "grid": {"lambda_": [1e-3, 1.0], "alpha": [0.3, 0.6]}})

    with pytest.raises(ValueError, match="criterion 'site' needs the family's feature site"):
        auto_calibrate(make_engine, lambda o: family_for(base, o), options, hp, copy.deepcopy(merged), base, experts,
                       datasets, _batches_of, torch.device("cpu"))
    site = _ProjectedSite()
    model = copy.deepcopy(merged)
    hp = replace(hp, num_calibration_examples=16)  # the tiny world's: below where the criterion was measured to hold
    with caplog.at_level("WARNING", logger="featcal_fusionbench.autoselect.search"):
        auto = auto_calibrate(make_engine, lambda o: family_for(base, o), options, hp, model, base, experts, datasets,
                              _batches_of, torch.device("cpu"), site=AlphaSite(site))["auto_select"]
    assert ("criterion site with 16 calibration examples per task: below 32 it was measured less accurate than "
            "criterion objective (featcal/auto_clip_ta)" in caplog.text)
    if site_parts is None:
        fit, held, _ = split_datasets(datasets, SelectionOptions(), 0)
        splits = [(fit, held)]
    else:  # each task's examples in four parts by fold_of, each held out once
        assignment = {t: fold_of(len(d), 4, 0, t) for t, d in datasets.items()}
        splits = [({t: [d[i] for i, f in enumerate(assignment[t]) if f != k] for t, d in datasets.items()},
                   {t: [d[i] for i, f in enumerate(assignment[t]) if f == k] for t, d in datasets.items()})
                  for k in range(4)]
    assert auto["criterion_used"] == "site" and auto["calibrations"] == 4 * len(splits)
    assert auto["site_parts"] == len(splits)
    family = family_for(base)
    expected, rows, best_at = {}, {}, {}
    for lam in (1e-3, 1.0):
        for alpha in (0.3, 0.6):
            per_split = []
            for fit, held in splits:
                scratch = copy.deepcopy(merged)
                FeatCalEngine(family, replace(hp, lambda_=lam, alpha=alpha), "cpu", progress=False).run(
                    scratch, base, experts, {t: _batches_of(fit[t]) for t in fit})
                with torch.no_grad():
                    per_split.append([F.cosine_similarity(
                        torch.cat([site.features(scratch, b) for b in _batches_of(held[t])]),
                        torch.cat([site.features(experts[t], b) for b in _batches_of(held[t])]), dim=-1).double()
                        for t in experts])
            per_example = [torch.cat(parts) for parts in zip(*per_split)]
            key = candidate_key({"lambda_": lam, "rho": hp.rho, "alpha": alpha, PATCH_WEIGHT: 1.0})  # the family's
            expected[key], rows[key] = sum(float(c.mean()) for c in per_example) / len(per_example), per_example
            assert auto["candidates"][key]["score"] == pytest.approx(expected[key], rel=1e-5)
            if alpha not in best_at or expected[key] > expected[best_at[alpha]]:
                best_at[alpha] = key
    assert set(auto["candidates"]) == set(expected)
    assert candidate_key(auto["choice"]["global"]) == max(expected, key=expected.get)
    # how clear alpha was: each alpha's best point, the best against the method's (or the runner-up), paired per
    # held-out example; the standard error of a mean over tasks of per-task mean differences, tasks independent
    stage = auto["alpha"]
    assert stage["criterion"] == "site" and stage["points"] == {"0.3": best_at[0.3], "0.6": best_at[0.6]}
    first, second = (best_at[0.6], best_at[0.3]) if expected[best_at[0.6]] > expected[best_at[0.3]] else (
        best_at[0.3], best_at[0.6])
    differences = [a - b for a, b in zip(rows[first], rows[second])]
    margin = sum(float(d.mean()) for d in differences) / len(differences)
    se = math.sqrt(sum(float(d.var()) / d.numel() for d in differences)) / len(differences)
    assert stage["chosen"] == auto["choice"]["global"]["alpha"] and not stage["kept"]
    assert stage["margin"] == pytest.approx(margin, rel=1e-5) and stage["margin_se"] == pytest.approx(margin / se, rel=1e-4)
    plain = copy.deepcopy(merged)
    FeatCalEngine(family, with_candidate(hp, auto["choice"]["global"]), "cpu", progress=False).run(
        plain, base, experts, {t: _batches_of(d) for t, d in datasets.items()})
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_criterion_site_below_the_examples_it_was_measured_at_runs_criterion_objective_instead(caplog):
    """With fewer calibration examples per task than the site's measure was measured to beat criterion objective
    at (the image site's 32), criterion site (few_examples: objective, the default) runs criterion objective with its
    defaults on the same seed: the same per-block choice and, bit for bit, the same model as that run, with the
    report's fallback entry, a warning and the log line saying so. At 32 criterion site itself runs."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.options import SITE_FEWEST_MEASURED
    from featcal_fusionbench.autoselect.search import AlphaSite

    world = tiny_world(batches=4)
    base, experts, merged, _ = world
    datasets = _datasets(world)
    site_options = SelectionOptions.parse({"criterion": "site", "search": "grid", "seed": 0, "keep_method_lambda": True,
                                           "grid": {"lambda_": [1e-3, 1.0], "alpha": [0.3, 0.6]}})
    hp = FeatCalHParams(num_calibration_examples=SITE_FEWEST_MEASURED - 1)

    def run(options, hparams):
        model = copy.deepcopy(merged)
        auto = auto_calibrate(make_engine, lambda o: family_for(base, o), options, hparams, model, base, experts,
                              datasets, _batches_of, torch.device("cpu"), site=AlphaSite(_ProjectedSite()))
        return model, auto["auto_select"]

    with caplog.at_level("WARNING", logger="featcal_fusionbench.autoselect.search"):
        model, auto = run(site_options, hp)
    assert "below 32 it was measured less accurate than criterion objective" in caplog.text
    assert "criterion objective chooses instead" in caplog.text
    plain_model, plain = run(SelectionOptions.parse({"criterion": "objective", "seed": 0}), hp)
    assert auto["criterion"] == "objective" and auto["fallback"] == {
        "from": "site", "to": "objective", "num_calibration_examples": 31, "fewest_measured": 32,
        "measure": "the held-out feature site's cosine"}
    assert auto["choice"] == plain["choice"] and auto["grid"] == plain["grid"] and "lambda" not in auto
    assert auto["grid"]["lambda_"] != [1e-3, 1.0], "the site's grid is not carried over"
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    line = describe_choice(auto)
    assert line == f"criterion objective in place of site (fewer than 32 examples per task): {describe_choice(plain)}"
    _, at_32 = run(site_options, replace(hp, num_calibration_examples=SITE_FEWEST_MEASURED))
    assert at_32["criterion"] == "site" and "fallback" not in at_32 and "lambda" in at_32


@pytest.mark.parametrize("noise_z", [1e9, 0.0])
def test_keep_method_lambda_takes_the_methods_lambda_unless_the_best_point_beats_it_beyond_the_noise(noise_z):
    """criterion site with keep_method_lambda: after the grid, the method's lambda at the best point's alpha and rho
    is calibrated on every split like a grid point and taken unless the best beats it by more than noise_z standard
    errors (paired per held-out example: the margin is the difference of the two points' means over tasks); the
    final calibration runs the point taken."""
    from featcal_fusionbench.autoselect.search import AlphaSite

    world = tiny_world(batches=4)
    base, experts, merged, _ = world
    hp = FeatCalHParams(num_calibration_examples=16)  # lambda 0.05, off the grid
    options = SelectionOptions.parse({"criterion": "site", "search": "grid", "seed": 0, "keep_method_lambda": True,
                                      "noise_z": noise_z, "few_examples": "site",
                                      "grid": {"lambda_": [1e-3, 1.0], "alpha": [0.3, 0.6]}})

    model = copy.deepcopy(merged)
    auto = auto_calibrate(make_engine, lambda o: family_for(base, o), options, hp, model, base, experts,
                          _datasets(world), _batches_of, torch.device("cpu"), site=AlphaSite(_ProjectedSite()))[
        "auto_select"]
    grid_points = {k: c["score"] for k, c in auto["candidates"].items() if not k.startswith("lambda_=0.05,")}
    best = max(grid_points, key=grid_points.get)
    best_alpha = float(best.split(",")[2].split("=")[1])
    rival = candidate_key({"lambda_": 0.05, "rho": hp.rho, "alpha": best_alpha, PATCH_WEIGHT: 1.0})
    assert len(grid_points) == 4 and set(auto["candidates"]) == {*grid_points, rival}
    assert auto["calibrations"] == 5  # four grid points and the method's lambda, one held-out quarter each
    rule = auto["lambda"]
    margin = grid_points[best] - auto["candidates"][rival]["score"]
    assert rule["method_lambda"] == 0.05 and rule["best"] == float(best.split(",")[0].split("=")[1])
    assert rule["margin"] == pytest.approx(margin, rel=1e-5)
    assert rule["kept"] == (rule["margin_se"] <= noise_z)
    assert candidate_key(auto["choice"]["global"]) == (rival if rule["kept"] else best)
    if noise_z == 0.0:
        assert rule["kept"] == (margin <= 0)
    else:
        assert rule["kept"] and "the method's lambda 0.05" in describe_choice(auto)
    plain = copy.deepcopy(merged)
    FeatCalEngine(family_for(base), with_candidate(hp, auto["choice"]["global"]), "cpu", progress=False).run(
        plain, base, experts, {t: _batches_of(d) for t, d in _datasets(world).items()})
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_the_lambda_verdict_weighs_the_methods_lambda_against_the_best_paired_per_example():
    from featcal_fusionbench.autoselect.search import lambda_verdict

    best, method = {"lambda_": 1e-4, "rho": 2.0, "alpha": 0.8}, {"lambda_": 1e-5, "rho": 2.0, "alpha": 0.8}
    a = torch.tensor([0.50, 0.70, 0.60, 0.90], dtype=torch.float64)
    b = torch.tensor([0.30, 0.20, 0.25, 0.40], dtype=torch.float64)
    shift = {"x": torch.tensor([0.02, -0.01, 0.03, 0.00], dtype=torch.float64),
             "y": torch.tensor([0.05, 0.01, 0.00, 0.02], dtype=torch.float64)}
    rows = {candidate_key(best): {"x": a + shift["x"], "y": b + shift["y"]}, candidate_key(method): {"x": a, "y": b}}
    means = [float(shift[t].mean()) for t in ("x", "y")]
    se = math.sqrt(sum(float(shift[t].var()) / 4 for t in ("x", "y"))) / 2
    z = (sum(means) / 2) / se
    for noise_z, kept in ((z + 0.01, True), (z - 0.01, False)):
        rule = lambda_verdict(rows, best, method, noise_z)
        assert rule["margin"] == pytest.approx(sum(means) / 2) and rule["margin_se"] == pytest.approx(z)
        assert rule["kept"] is kept and rule["method_lambda"] == 1e-5 and rule["best"] == 1e-4
    assert not lambda_verdict({**rows, candidate_key(method): None}, best, method, 0.0)["kept"]  # not finite
    assert lambda_verdict(rows, best, best, 1e9) == {"method_lambda": 1e-4, "best": 1e-4, "kept": False,
                                                     "margin": None, "margin_se": None}
    behind = lambda_verdict({candidate_key(best): rows[candidate_key(method)],
                             candidate_key(method): rows[candidate_key(best)]}, best, method, 2.0)
    assert behind["kept"] and behind["margin_se"] < 0
    def line(rule, scores):
        return describe_choice({"criterion": "site", "choice": {"global": method}, "lambda": rule, "candidates": {
            candidate_key(best): {"score": scores[0]}, candidate_key(method): {"score": scores[1]}}})

    assert ("(site 0.5000; best lambda 0.0001, rho 2, alpha 0.8 0.1000 ahead), the method's lambda 1e-05 kept: "
            f"0.0001 ahead by {z:.1f} standard errors, within the noise") in line(
        lambda_verdict(rows, best, method, z + 0.01), (0.6, 0.5))
    assert ("(site 0.6000; runner-up lambda 0.0001, rho 2, alpha 0.8 0.1000 behind), the method's lambda 1e-05, "
            f"{-behind['margin_se']:.1f} standard errors ahead of 0.0001") in line(behind, (0.5, 0.6))


def test_a_criterion_site_point_whose_calibration_is_not_finite_scores_nan_and_calibrates_no_further_part():
    """With each part held out in turn, a point whose first part's calibration raises NonFiniteError scores NaN
    (never chosen, not weighed in the alpha margin) and is not calibrated on the remaining parts."""
    from featcal_fusionbench.autoselect.search import AlphaSite
    from featcal_fusionbench.core.moments import NonFiniteError

    world = tiny_world(batches=4)
    base, experts, merged, _ = world
    datasets = _datasets(world)
    options = SelectionOptions.parse({"criterion": "site", "search": "grid", "seed": 0, "site_parts": "auto",
                                      "few_examples": "site", "grid": {"lambda_": [1e-3, 1.0], "alpha": [0.3, 0.6]}})
    runs = []

    class Failing(FeatCalEngine):
        def run(self, model, *args, **kwargs):
            runs.append((self.hparams.lambda_, self.hparams.alpha))
            if (self.hparams.lambda_, self.hparams.alpha) == (1.0, 0.6):
                raise NonFiniteError("a stand-in for a non-finite statistic")
            return super().run(model, *args, **kwargs)

    def failing_engine(hparams, family, search=False, **kwargs):
        return Failing(family, hparams, "cpu", progress=False, **kwargs)

    hp = FeatCalHParams(num_calibration_examples=16)
    auto = auto_calibrate(failing_engine, lambda o: family_for(base, o), options, hp, copy.deepcopy(merged), base,
                          experts, datasets, _batches_of, torch.device("cpu"), site=AlphaSite(_ProjectedSite()))[
        "auto_select"]
    failed = candidate_key({"lambda_": 1.0, "rho": hp.rho, "alpha": 0.6, PATCH_WEIGHT: 1.0})
    assert math.isnan(auto["candidates"][failed]["score"])
    assert all(math.isfinite(c["score"]) for k, c in auto["candidates"].items() if k != failed)
    assert runs.count((1.0, 0.6)) == 1  # its first part failed: the other three were not calibrated
    assert auto["site_parts"] == 4 and len(runs) == 3 * 4 + 1 + 1  # three points x four parts, the failed one, the final
    assert candidate_key(auto["choice"]["global"]) != failed and auto["alpha"]["points"]["0.6"] != failed


def test_criterion_site_runs_in_the_method_on_a_clip_pool(toy_world, tmp_path):
    make(tmp_path, auto_select={"criterion": "site", "search": "grid", "few_examples": "site",
                                "grid": {"lambda_": [1e-3], "alpha": [0.3, 0.6]}}).run(load_pool(toy_world))
    auto = json.loads(next(tmp_path.rglob(REPORT_NAME)).read_text())["auto_select"]
    assert auto["criterion_used"] == "site" and {key.rsplit(",", 1)[0] for key in auto["candidates"]} == {
        "lambda_=0.001,rho=2,alpha=0.3", "lambda_=0.001,rho=2,alpha=0.6"}, "the method's patch weight alone"
    assert auto["choice"]["global"]["alpha"] in (0.3, 0.6)
    line = describe_choice(auto)
    assert line.startswith("chose lambda 0.001, rho 2, alpha ") and "(site " in line and "runner-up lambda 0.001" in line
    assert "by the held-out feature site's cosine" in line and "standard errors ahead of " in line


def test_the_alpha_stage_keeps_the_methods_alpha_unless_beaten_by_more_than_the_noise():
    _, report = _search(tiny_world(batches=4), "objective", alpha_criterion="drift", noise_z=1e9, widen=False,
                        least_shrinkage=False, grid=ALPHA_GRID)
    auto = report["auto_select"]
    stage = auto["alpha"]
    assert stage["chosen"] == 0.3 and stage["kept"] == (stage["best"] != 0.3)
    assert {key.split(",")[2] for key in auto["choice"]["per_block"]} == {"alpha=0.3"}
    if stage["kept"]:
        assert "the method's alpha 0.3 kept" in describe_choice(auto)


def test_the_alpha_stage_is_refused_on_several_devices_before_any_model_is_read(toy_world):
    """drift's stage on several devices, and site's where a fit part would leave a device without examples."""
    from types import SimpleNamespace

    algorithm = FeatCalAlgorithm(auto_select={"alpha_criterion": "drift"})
    algorithm._fabric_instance = SimpleNamespace(world_size=2, _loggers=None)
    with pytest.raises(ValueError, match="alpha_criterion 'drift' runs on one device only"):
        algorithm._check(load_pool(toy_world), ["toy_0"])
    algorithm = FeatCalAlgorithm(auto_select={"alpha_criterion": "site", "folds": 2}, num_calibration_examples=6)
    algorithm._fabric_instance = SimpleNamespace(world_size=2, _loggers=None)
    with pytest.raises(ValueError, match=r"'site' holds out each of 4 parts .*: 6 example\(s\) leave a part of 1, "
                                         r"fewer than one per device \(2\); raise num_calibration_examples to 8"):
        algorithm._check(load_pool(toy_world), ["toy_0"])


def _least_shrinkage(per_part, best, least_shrinkage=True, widened=None):
    from featcal_fusionbench.autoselect.policy import CrossFitChoice, CrossFitSelection, Search

    search = Search((1e-6, 1e-5, 1e-4, 1e-3), (2.0,), (0.3,), noise_z=2.0, least_shrinkage=least_shrinkage)
    choice = CrossFitChoice(CrossFitSelection(search, folds=4), FeatCalHParams())
    return choice._least_shrinkage(per_part, best, search.lambdas, widened or {})


def test_least_shrinkage_takes_the_smallest_lambda_within_the_noise_of_the_held_out_best():
    """Per fold held-out scores (lower is better): 1e-3 the best; 1e-4 behind it by less than two standard errors of
    the paired fold differences, 1e-5 and 1e-6 by more; a candidate at another rho is never taken. The smallest
    lambda within the noise is 1e-4; with the rule off, or with nothing within the noise, the best stays."""
    key = lambda lam, rho=2.0: f"lambda_={lam:g},rho={rho:g},alpha=0.3"  # noqa: E731
    per_part = {key(1e-3): [0.0, 0.0, 0.0, 0.0], key(1e-4): [0.3, -0.2, 0.4, -0.1],  # +0.4, se 0.55
                key(1e-5): [1.0, 1.1, 0.9, 1.0], key(1e-6): [2.0, 2.1, 1.9, 2.0],  # +4.0, se 0.16; +8.0
                key(1e-7, rho=1.0): [0.0, 0.0, 0.0, 0.0]}
    best = {"lambda_": 1e-3, "rho": 2.0, "alpha": 0.3}
    assert _least_shrinkage(per_part, best) == ({**best, "lambda_": 1e-4}, 1e-3)
    assert _least_shrinkage(per_part, best, least_shrinkage=False) == (best, None)
    per_part[key(1e-4)] = [1.0, 1.0, 1.1, 0.9]
    assert _least_shrinkage(per_part, best) == (best, None)
    # a value the widening added is a candidate like the grid's
    per_part[key(1e-7)] = [0.1, -0.1, 0.0, 0.05]
    assert _least_shrinkage(per_part, best, widened={"lambda_": [1e-7]}) == ({**best, "lambda_": 1e-7}, 1e-3)


def test_the_methods_values_are_weighed_against_the_held_out_best_not_against_the_least_shrinkage_choice():
    """As in block 0 of the quick CLIP world at n = 8, seed 44: lambda 1e-3 the held-out best, the method's 0.05
    behind it by far more than two standard errors, 1e-6 behind it within its own (larger) noise and, in raw
    total, behind the method's too. Least shrinkage takes 1e-6; the method's values, which the evidence rejects,
    are not kept against it. Where the method's values are within the noise of the best, they are kept."""
    from featcal_fusionbench.autoselect.policy import CrossFitChoice, CrossFitSelection, Search

    key = lambda lam: f"lambda_={lam:g},rho=2,alpha=0.3"  # noqa: E731
    per_part = {key(1e-3): [0.0, 0.0, 0.0, 0.0], key(0.05): [0.5, 0.6, 0.5, 0.6],  # +2.2, se 0.12
                key(1e-6): [3.0, -2.0, 3.5, -1.5]}  # +3.0, se 5.8
    search = Search((1e-6, 1e-3), (2.0,), (0.3,), noise_z=2.0)
    choice = CrossFitChoice(CrossFitSelection(search, folds=4), FeatCalHParams(lambda_=0.05))
    best = {"lambda_": 1e-3, "rho": 2.0, "alpha": 0.3}
    relaxed, held_out_best = choice._least_shrinkage(per_part, best, search.lambdas, {})
    assert (relaxed, held_out_best) == ({**best, "lambda_": 1e-6}, 1e-3)
    reference = {**best, "lambda_": 0.05}
    totals = lambda: {k: sum(v) for k, v in per_part.items()}  # noqa: E731
    assert choice._keep_within_noise(per_part, totals(), relaxed, reference) == (relaxed, None)
    per_part[key(0.05)] = [0.5, -0.5, 0.6, -0.4]  # +0.2, se 1.1: within the noise of the best
    assert choice._keep_within_noise(per_part, totals(), relaxed, reference) == (reference, "method")


def test_the_log_line_names_the_blocks_whose_lambda_is_the_least_shrinkage_within_the_noise():
    blocks = [{"block": 0, "chosen": "lambda_=1e-05,rho=2,alpha=0.3", "margin": 1.0, "margin_se": 3.0},
              {"block": 1, "chosen": "lambda_=1e-05,rho=2,alpha=0.3", "margin": -0.2, "margin_se": -0.5,
               "held_out_best_lambda": 1e-4},
              {"block": 2, "chosen": "lambda_=1e-06,rho=2,alpha=0.3", "margin": -0.1, "margin_se": -0.4,
               "held_out_best_lambda": 1e-5}]
    line = describe_choice({"choice": {"per_block": [b["chosen"] for b in blocks]}, "blocks": blocks, "noise_z": 2.0})
    assert "lambda the smallest within the noise of the held-out best in block(s) 1-2" in line
    assert "runner-up 3.0-3.0 standard errors behind" in line


def test_a_winning_grid_edge_is_widened_a_decade_at_a_time_within_the_floor_and_the_cap():
    """A two-value lambda grid on a tiny world: its winning edge is extended a decade at a time while the new value
    wins, never under the floor of float32 moments (their rounding, ~1.2e-7) nor over the cap; the report names
    the edge where the choice stayed on it."""
    from featcal_fusionbench.autoselect.policy import LAMBDA_CAP

    _, report = _search(tiny_world(batches=4), "objective", noise_z=0.0,
                        grid={"lambda_": [1e-3, 1e-2], "rho": [2.0], "alpha": [0.3]})
    widened_any = False
    for block in report["auto_select"]["blocks"]:
        chosen = float(block["chosen"].split(",")[0].split("=")[1])
        widened = block.get("widened", {}).get("lambda_", [])
        widened_any |= bool(widened)
        assert all(1.19e-7 <= v <= LAMBDA_CAP for v in widened)
        below, above = [v for v in widened if v < 1e-3], [v for v in widened if v > 1e-2]
        assert below == sorted(below, reverse=True) and above == sorted(above)
        assert [round(b / a, 6) for a, b in zip([1e-3, *below], below)] == [0.1] * len(below)
        assert [round(b / a, 6) for a, b in zip([1e-2, *above], above)] == [10.0] * len(above)
        if chosen not in (1e-3, 1e-2):
            assert chosen in widened
        if chosen == min([1e-3, *widened]):
            assert any(e.startswith("lambda at the") for e in block["edge"])
        if chosen == max([1e-2, *widened]):
            assert "lambda at the grid's high edge" in block["edge"]
    assert widened_any


@pytest.mark.parametrize("criterion", ["objective", "drift"])
def test_a_one_point_grid_gives_exactly_the_calibration_with_those_values(criterion):
    """Each block is solved on all examples: with nothing to choose, the one pass (objective) is bit for bit an
    ordinary calibration on the folds' batches one after the other; drift's final calibration is one on all
    examples in their order."""
    world = tiny_world(batches=4)
    base, experts, merged, data = world
    grid = {"lambda_": [0.05], "rho": [2.0], "alpha": [0.3], "last_block_patch_token_weight": [1.0]}
    chosen, report = _search(world, criterion, grid=grid, **({"widen": False} if criterion == "objective" else {}))
    assert report["auto_select"]["calibrations"] == 1
    plain = copy.deepcopy(merged)
    datasets = _datasets(world)
    if criterion == "objective":
        parts, _ = fold_datasets(datasets, 4, 0)
        batches = {t: [b for part in parts[t] for b in _batches_of(part)] for t in datasets}
    else:
        batches = {t: _batches_of(d) for t, d in datasets.items()}
    FeatCalEngine(family_for(base), FeatCalHParams(), "cpu", progress=False).run(plain, base, experts, batches)
    for p, q in zip(chosen.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_coordinate_search_tries_lambda_then_rho_and_alpha():
    _, report = _search(tiny_world(batches=4), "drift")
    auto = report["auto_select"]
    # 3 lambdas, then 2 x 2 (rho, alpha) of which none repeats a lambda-stage point (rho 2.0 alpha 0.3 did), then
    # the patch weight's 2 values, one already scored.
    assert auto["calibrations"] == len(auto["candidates"]) == 3 + 3 + 1
    assert auto["criterion_used"] == "drift"
    best = max(auto["candidates"].values(), key=lambda s: s["score"])["score"]
    chosen = ",".join(f"{k}={v:g}" for k, v in auto["choice"]["global"].items())
    assert auto["candidates"][chosen]["score"] == best


def test_agreement_uses_the_language_models_head_and_clip_falls_back_to_drift():
    llm = _rows(tiny_causal_lm_world("llama", batches=4))
    _, report = _search(llm, "agreement", grid={"lambda_": [1e-3, 1.0], "rho": [1.0], "alpha": [0.3]})
    auto = report["auto_select"]
    assert auto["criterion_used"] == "agreement"
    assert all(0.0 <= s["score"] <= 1.0 for s in auto["candidates"].values())
    _, clip = _search(tiny_world(batches=4), "agreement", grid={"lambda_": [1.0], "rho": [1.0], "alpha": [0.3]})
    assert clip["auto_select"]["criterion_used"] == "drift"


# ---- through FusionBench, without labels ------------------------------------------------------------------------


class LabelTrap(dict):
    def __getitem__(self, key):
        if key == "label":
            raise AssertionError("a label was read")
        return super().__getitem__(key)


class Unlabeled:
    """A dataset whose rows raise on their label."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return LabelTrap(self.dataset[index])


@pytest.mark.parametrize("criterion", ["objective", "drift", "site"])
def test_the_selection_never_reads_a_label_and_reports_its_choice(toy_world, tmp_path, criterion):
    pool = load_pool(toy_world)
    load = pool.load_train_dataset
    pool.load_train_dataset = lambda task: Unlabeled(load(task))
    grid = {"lambda_": [0.01, 1.0], "rho": [2.0], "alpha": [0.3]}
    few = {"few_examples": "site"} if criterion == "site" else {}  # 16 per task: criterion site itself, not objective
    make(tmp_path, auto_select={"criterion": criterion, "grid": grid, **few}).run(pool)
    report = json.loads(next(tmp_path.rglob(REPORT_NAME)).read_text())["auto_select"]
    sizes = report["folds_per_task"] if criterion == "objective" else report["split"]
    assert report["criterion"] == criterion and sizes["toy_0"] == ([2] * 8 if criterion == "objective"
                                                                   else {"fit": 12, "heldout": 4})
    assert report["grid"]["lambda_"] == [0.01, 1.0] and report["choice"]


def test_auto_select_off_runs_no_search(toy_world, tmp_path):
    make(tmp_path, auto_select=False).run(load_pool(toy_world))
    report = json.loads(next(tmp_path.rglob(REPORT_NAME)).read_text())
    assert "auto_select" not in report and all("hparams" not in b and "selection" not in b for b in report["blocks"])


# ---- configs -------------------------------------------------------------------------------------------------------


def test_the_auto_config_composes_and_a_lambda_multirun_still_sweeps():
    from dataclasses import replace

    import fusion_bench_config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweep = OverridesParser.create().parse_overrides(["method.lambda_=0.01,0.05"])[0]
    values = list(sweep.sweep_iterator())
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        auto = compose("fabric_model_fusion", overrides=["method=featcal/auto_clip_ta"]).method
        t5 = compose("fabric_model_fusion", overrides=["method=featcal/auto_flan_t5_ta"]).method
        site = compose("fabric_model_fusion", overrides=["method=featcal/auto_clip_site"]).method
        paper_t5 = compose("fabric_model_fusion", overrides=["method=featcal/flan_t5_ta"]).method
        t5_site = compose("fabric_model_fusion", overrides=["method=featcal/auto_flan_t5_site"]).method
        runs = [compose("fabric_model_fusion", overrides=["method=featcal", f"method.lambda_={v}"]).method for v in values]
    GlobalHydra.instance().clear()
    options = SelectionOptions.parse(OmegaConf.to_container(auto.auto_select))
    assert options.criterion == "objective" and options.folds == "auto" and options.noise_z == 2.0 and options.widen
    # the T5 one: the paper's FLAN-T5 configuration as its starting point, the same options
    assert SelectionOptions.parse(OmegaConf.to_container(t5.auto_select)) == options
    assert {k: v for k, v in t5.items() if k != "auto_select"} == {k: v for k, v in paper_t5.items() if k != "auto_select"}
    assert [r.lambda_ for r in runs] == [0.01, 0.05] and all(r.auto_select is False for r in runs)
    # the site one: the paper's CLIP values, one (lambda, alpha) by the feature site over every point of its grid
    site_options = SelectionOptions.parse(OmegaConf.to_container(site.auto_select))
    assert site_options.criterion == "site" and site_options.search == "grid" and not site_options.grid
    assert site_options.few_examples == "objective" and site_options.fallback() == replace(options, seed=None)
    assert {k: v for k, v in site.items() if k != "auto_select"} == {k: v for k, v in auto.items() if k != "auto_select"}
    # the T5 site one: the paper's FLAN-T5 values, one (lambda, alpha) over the site's lambdas and the paper's alpha and
    # those above it, every part held out in turn, the paper's lambda kept unless beaten beyond the noise
    t5_site_options = SelectionOptions.parse(OmegaConf.to_container(t5_site.auto_select))
    assert t5_site_options == replace(site_options, site_parts="all", keep_method_lambda=True,
                                      grid={"alpha": [0.6, 0.8, 1.0]})
    assert {k: v for k, v in t5_site.items() if k != "auto_select"} == {k: v for k, v in t5.items() if k != "auto_select"}


def test_solutions_over_rho_equal_a_solve_at_each_rho():
    """The rho stage solves each site twice (rho 0 and 1) and takes every rho from the affine combination: equal
    to solving at that rho, to float64 rounding, for weights, biases and LayerNorm affines."""
    from dataclasses import replace

    from featcal_fusionbench.autoselect.policy import CrossFitSelection, Search

    checked = []

    class Probe(CrossFitSelection):
        def for_block(self, index, hparams):
            choice = super().for_block(index, hparams)
            original = choice.choose

            def choose(step):
                sums = choice.parts[hparams.alpha][0]
                direct = {rho: {} for rho in (0.5, 2.5, -1.0)}
                for rho in direct:
                    step.solve(sums, replace(hparams, rho=rho),
                               visit=lambda name, values, rho=rho: direct[rho].__setitem__(name, values))
                step.solve_over_rho(sums, hparams, list(direct), lambda rho, name, values: checked.append(
                    all(torch.allclose(values[a], direct[rho][name][a], rtol=1e-9, atol=1e-12) for a in values)))
                return original(step)

            choice.choose = choose
            return choice

    base, experts, merged, data = tiny_world(batches=4)
    policy = Probe(Search((1e-3,), (2.0,), (0.3,), widen=False), folds=2)
    FeatCalEngine(family_for(base), FeatCalHParams(), "cpu", progress=False, policy=policy).run(
        copy.deepcopy(merged), base, experts, {t: iter(v) for t, v in data.items()}, {t: [2, 2] for t in data})
    assert checked and all(checked)
