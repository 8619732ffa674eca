"""``method.auto_select``: the search for lambda / rho / alpha without labels, then the final calibration (the
options and grids are in ``options``, the per-block policy in ``policy``, the math in ``core``). No label is read.

- criterion ``objective``: the calibration itself, in one pass over the model (in memory or out of core alike).
  Each task's calibration examples are in ``folds`` parts (assigned over the whole set, so that several devices
  assign them as one does). At each block every part's moments are collected once; every candidate is solved on
  all parts but one and scored on that one, for each part (``policy.CrossFitSelection``); the block is then solved
  with the choice on ALL of each task's examples, loaded (or written), and every stream advances through it, so
  the next block chooses on the chosen prefix (greedy, per block). ``search_seconds`` is the time spent choosing
  (the parts' collections and the candidates' solves).
- ``alpha_criterion: drift`` (with ``objective``): before that pass, each task's examples split into a fit and a
  held-out part; a copy of the merged model calibrated on the fit part with the method's alpha, lambda and rho chosen
  per block as above, then one copy per other alpha with that per-block schedule; the alpha whose last-block output
  on the held-out part lies closest to the experts' (mean cosine, paired per example) is taken if it beats the
  method's by more than ``noise_z`` standard errors, and the pass above runs with it. ``alpha_criterion: site``:
  the same split and rule, each alpha at or above the method's scored by the cosine of its held-out features at the
  family's feature site (one row per example, ``AlphaSite``: the projected image embedding that CLIP's zero-shot
  heads read) to the experts' (on T5, whose site has a row per token, ``ExpertProbability``: the expert's
  probability of the model's greedy output, or where the expert writes numbers each example's share of Spearman's
  rho with them), each after a calibration of the fit part with fixed lambda and rho; up
  to 64 examples per task every quarter is held out in turn (``site_stage``).
- criteria ``drift`` / ``agreement`` / ``site``: each task's examples split into a fit and a held-out part; one
  calibration of a copy of the merged model on the fit part per candidate (coordinate or full grid), scored on the
  held-out part's last-block outputs against the experts' (``site``: its rows at the family's feature site, as
  ``alpha_criterion: site`` scores them, one lambda and alpha for the model; with ``site_parts: auto`` each part
  held out in turn, every example's row pooled; with ``keep_method_lambda`` the method's lambda at the best point's
  alpha is scored too and taken unless the best beats it by more than ``noise_z`` standard errors, paired per
  held-out example: ``lambda_verdict``). The experts' held-out outputs do not
  depend on the hyperparameters and are computed once. Then the final calibration runs on ALL calibration examples with the
  chosen values. They hold the merged model whole (a copy per candidate).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from ..core.hparams import FeatCalHParams
from ..core.meters import AgreementMeter, DriftMeter, example_cosines, paired_difference, rank_agreement
from ..core.moments import NonFiniteError
from ..core.sampling import fold_of, heldout_split, subset
from ..engine.loop import FeatCalEngine
from ..engine.policy import FixedHParams
from ..evaluation.text_taskpool import load_tokenizer
from ..families import ModelFamily
from ..models.residency import on_device
from .policy import CrossFitSelection, Search
from .options import (
    PATCH_WEIGHT,
    Candidate,
    GENERATION_FEWEST_MEASURED,
    SITE_FEWEST_MEASURED,
    SelectionOptions,
    all_candidates,
    best_of,
    candidate_key,
    coordinate_stages,
    mean_over_tasks,
    stage_candidates,
    with_candidate,
)

log = logging.getLogger(__name__)

#: (hparams, family, search=bool, policy=...) -> an engine configured like the method's own
EngineFactory = Callable[..., FeatCalEngine]


def split_datasets(datasets: Mapping[str, Any], options: SelectionOptions, seed: int):
    """Each task's (fit, held-out) subsets and the sizes, for the report."""
    fit, held, sizes = {}, {}, {}
    for task, dataset in datasets.items():
        fit_idx, held_idx = heldout_split(len(dataset), options.heldout_fraction, seed, task)
        fit[task], held[task] = subset(dataset, fit_idx), subset(dataset, held_idx)
        sizes[task] = {"fit": len(fit_idx), "heldout": len(held_idx)}
    return fit, held, sizes


# ---- criterion "objective": per-block choice inside the one calibration -----------------------------------------


def fold_datasets(datasets: Mapping[str, Any], folds: int, seed: int, shard=(0, 1)):
    """Each task's parts on this device (``folds`` subsets of its examples) and every fold's size, for the report.
    The folds are assigned over each task's whole set (``datasets``, unsharded); ``shard``: (rank, world size):
    with several devices each fold is shared out (every world-size-th of its examples from ``rank``), so every
    device holds a part of every fold and the folds are a single device's."""
    rank, world_size = shard
    parts, sizes = {}, {}
    for task, dataset in datasets.items():
        assignment = fold_of(len(dataset), folds, seed, task)
        members = [[p for p, f in enumerate(assignment) if f == k] for k in range(folds)]
        if min(len(m) for m in members) < world_size:
            raise ValueError(f"task {task!r}: a fold of {min(len(m) for m in members)} example(s) cannot be shared "
                             f"by {world_size} devices; raise num_calibration_examples or lower auto_select.folds")
        parts[task] = [subset(dataset, m[rank::world_size]) for m in members]
        sizes[task] = [len(m) for m in members]
    return parts, sizes


def search_for(options: SelectionOptions, hp: FeatCalHParams, grid) -> Search:
    """The objective's search over ``grid``, its lambda floor from the moments' dtype: below the dtype's rounding
    of a unit-norm Gram (and the solve's own ``eps``) a ridge no longer tells directions apart."""
    floor = max(hp.eps, float(torch.finfo(hp.torch_accumulation_dtype).eps))
    return Search(tuple(grid["lambda_"]), tuple(grid["rho"]), tuple(grid["alpha"]), mode=options.search,
                  floor=floor, widen=options.widen, noise_z=options.noise_z,
                  least_shrinkage=options.least_shrinkage)


def calibrate_per_block(make_engine: EngineFactory, family, hp, options, grid, merged, base, experts, parts,
                        batches_of, trial=False):
    """Calibrate ``merged`` in place, each block's values chosen by cross-fitting over each task's ``parts``
    (``policy.CrossFitSelection``) and the block then solved with them on all of them; the engine's report and the
    search's. ``trial``: a run of the alpha stage (nothing logged or written)."""
    folds = len(next(iter(parts.values())))  # every task has the same number of parts
    selection = CrossFitSelection(search_for(options, hp, grid), folds)
    batches = {t: [list(batches_of(p)) for p in ps] for t, ps in parts.items()}
    report = make_engine(hp, family, search=trial, policy=selection).run(
        merged, base, experts, {t: [b for part in bs for b in part] for t, bs in batches.items()},
        {t: [len(part) for part in bs] for t, bs in batches.items()})
    fixed = candidate_key({k: getattr(hp, k) for k in ("lambda_", "rho", "alpha")})
    per_block = [e["selection"]["chosen"] if "selection" in e else fixed for e in report["blocks"]]
    blocks = [{"block": e["block"], **e["selection"]} for e in report["blocks"] if "selection" in e]
    search_seconds = sum(e.get("selection_seconds", 0.0) for e in report["blocks"])
    search = {"blocks": blocks, "solves": selection.solves, "calibrations": 1, "search_seconds": search_seconds,
              "final_seconds": report["seconds"] - search_seconds}
    return report, {"per_block": per_block}, search


# ---- alpha_criterion "drift" / "site": one alpha for the model, then the per-block pass -------------------------


class AlphaSite:
    """The experts' held-out features at the family's feature site (``FeatureSite``, one row per example: CLIP's and
    OpenCLIP's projected image embedding, what the task's zero-shot head reads), for ``alpha_criterion: site`` and
    criterion ``site``. The site is built from the pool before the merge (``alpha_site``), the experts' rows once for
    every candidate."""

    criterion = "site"
    measure = "the held-out feature site's cosine"
    fewest_measured, below_it = SITE_FEWEST_MEASURED, ("measured less accurate than criterion objective "
                                                       "(featcal/auto_clip_ta) on seven builds of nine")

    def __init__(self, site):
        self.site = site
        self.rows: Dict[str, torch.Tensor] = {}
        self.device = None

    def fresh(self) -> "AlphaSite":
        """The same site without held-out rows, for another held-out part."""
        return AlphaSite(self.site)

    def hold_out(self, family, experts, held_batches, device) -> "AlphaSite":
        """Compute the experts' rows on their tasks' held-out batches, the reference of every alpha."""
        self.site.to(device)
        self.device = device
        self.rows = {task: self.features(family, expert, held_batches(task), device) for task, expert in experts.items()}
        return self

    @torch.no_grad()
    def features(self, family, model: nn.Module, batches, device) -> torch.Tensor:
        with on_device([model], device):  # the whole tower: a lazy expert is read, used and released
            return torch.cat([self.site.features(model, family.inputs_to(b, device)).float().cpu() for b in batches])

    def example_scores(self, family, model, held_batches) -> Dict[str, torch.Tensor]:
        """Per task, each held-out example's cosine of ``model``'s row to the expert's (higher is nearer;
        ``HeldoutReference``'s and ``ExpertProbability``'s signature, so the alpha stage scores any alike)."""
        return {task: torch.nn.functional.cosine_similarity(
                    self.features(family, model, held_batches(task), self.device), reference, dim=-1)
                for task, reference in self.rows.items()}


class ExpertProbability:
    """``site`` on a generating family whose feature site has a row per token (FLAN-T5): per held-out example, the
    probability the task's expert gives the model's greedy output (``OutputSite``). Were the expert's probabilities
    its accuracy, this would be the model's expected accuracy on the task, read without a label; a task the expert
    cannot do (every output improbable) weighs little, where agreement with its argmax would count in full.

    A task whose expert writes numbers (more than ``NUMBER_SHARE`` of its held-out outputs parse with ``float``, as
    FusionBench's ``evaluate_spearman_rho`` parses them; words never do) is scored as its task pool scores numbers,
    by closeness of rank: each example's share of Spearman's rho between the model's numbers and the expert's
    (``rank_agreement``), text that does not parse read as 0 as FusionBench reads it. The exact answer's probability
    misses what such a task gains: on a text build where alpha 0.8 beat 0.6 by 6-7 points of ``wordcount``'s rho, the
    expert's probability of the model's count rose 0.01 (docs/featcal.md). Needs the pool's tokenizer to read text;
    without one every task is scored by probability."""

    criterion = "site"
    fewest_measured, below_it = GENERATION_FEWEST_MEASURED, (
        "not measured to beat criterion objective, and at 32 it lay farther from the test-label oracle than "
        "featcal/auto_flan_t5_ta, at ten times its cost")

    def __init__(self, output):
        self.output = output
        self.experts: Mapping[str, nn.Module] = {}
        self.device = None
        self.numbers: Dict[str, torch.Tensor] = {}  # a number-writing task's expert's numbers on its held-out part

    @property
    def measure(self) -> str:
        measure = "the experts' probability of the held-out generations"
        if self.numbers:
            measure += f" (Spearman's rho with the expert's numbers on {', '.join(sorted(self.numbers))})"
        return measure

    def fresh(self) -> "ExpertProbability":
        return ExpertProbability(self.output)

    @torch.no_grad()
    def hold_out(self, family, experts, held_batches, device) -> "ExpertProbability":
        """Which tasks' experts write numbers, and those numbers (the rest is scored of each candidate's output)."""
        self.experts, self.device, self.numbers = experts, device, {}
        if self.output.tokenizer is None:
            return self
        for task, expert in experts.items():
            batches = [family.inputs_to(b, device) for b in held_batches(task)]
            with on_device([expert], device):
                written = as_numbers([t for b in batches for t in self.output.texts(self.output.generate(expert, b))])
            if writes_numbers(written):
                self.numbers[task] = written.nan_to_num(0.0)
        return self

    @torch.no_grad()
    def example_scores(self, family, model, held_batches) -> Dict[str, torch.Tensor]:
        out = {}
        for task, expert in self.experts.items():
            batches = [family.inputs_to(b, self.device) for b in held_batches(task)]
            with on_device([model], self.device):
                outputs = [self.output.generate(model, b) for b in batches]
            if task in self.numbers:
                texts = [t for o in outputs for t in self.output.texts(o)]
                out[task] = rank_agreement(as_numbers(texts).nan_to_num(0.0), self.numbers[task]).float()
                continue
            with on_device([expert], self.device):
                out[task] = torch.cat([self.output.probability(expert, b, o).float().cpu()
                                       for b, o in zip(batches, outputs)])
        return out


#: more than this share of an expert's held-out outputs parse as numbers: the task is scored by rank
NUMBER_SHARE = 0.5


def as_numbers(texts: List[str]) -> torch.Tensor:
    """``texts`` parsed as FusionBench's ``evaluate_spearman_rho`` parses them (``float``), float64; NaN where a text
    does not parse or is not finite (the score reads those as 0, as FusionBench reads text that does not parse)."""
    values = []
    for text in texts:
        try:
            values.append(float(text))
        except ValueError:
            values.append(math.nan)
    values = torch.tensor(values, dtype=torch.float64)
    return values.where(values.isfinite(), torch.full_like(values, math.nan))


def writes_numbers(values: torch.Tensor) -> bool:
    """Whether an expert's parsed outputs (``as_numbers``) are a number task's: more than ``NUMBER_SHARE`` parse."""
    return int(values.isfinite().sum()) > NUMBER_SHARE * values.numel()


def pool_tokenizer(modelpool):
    """The pool's tokenizer from its ``tokenizer`` config, or None. Not ``Seq2SeqLMPool.load_tokenizer``: in
    FusionBench 0.2.33 it returns ``isinstance(self._tokenizer, ...)``, which raises (seq2seq_lm/modelpool.py)."""
    config = getattr(modelpool, "_tokenizer", None)
    return None if config is None else load_tokenizer(config)


def alpha_site(family: ModelFamily, modelpool, base: nn.Module):
    """What criterion or ``alpha_criterion`` ``site`` scores (``AlphaSite``, or ``ExpertProbability`` for a family
    with an ``output_site``), or a ValueError naming why this model has neither (before the merge)."""
    if family.output_site() is not None:  # the pool's tokenizer is loaded only for a family that generates
        return ExpertProbability(family.output_site(pool_tokenizer(modelpool)))
    try:
        site = family.feature_site(modelpool, base)
    except TypeError as error:
        raise ValueError(f"auto_select 'site' (criterion or alpha_criterion) reads the family's feature site: "
                         f"{error}") from None
    if not site.one_row_per_example:
        raise ValueError(
            f"auto_select 'site' (criterion or alpha_criterion) compares one feature row per example (the image "
            f"families: CLIP, OpenCLIP) or a generated output (T5); the {family.name} family's site has one row "
            f"per token. Use criterion objective with alpha_criterion=none (or drift)"
        )
    return AlphaSite(site)


def choose_alpha(make_engine: EngineFactory, family, options: SelectionOptions, hp, grid, merged, base, experts,
                 datasets, batches_of, device, seed, site=None, shard=(0, 1)) -> Dict[str, Any]:
    """The alpha stage's report (``chosen`` among it). The per-block objective cannot rank alpha (it scores against
    the experts' own features and favours the largest), so alpha is scored where its effect shows: at the end of the
    model, after every block has calibrated on inputs that earlier blocks' alpha shaped. ``drift``: lambda and rho
    are chosen per block at the method's alpha (the one pass's rule, on the fit part's folds) and that schedule
    serves every other alpha, one calibration each. ``site``: ``site_stage``."""
    if site is not None:
        return site_stage(make_engine, family, options, hp, grid, merged, base, experts, datasets, batches_of,
                          device, seed, site, shard)
    started = time.perf_counter()
    fit, held, sizes = split_datasets(datasets, options, seed)
    fit_folds = options.folds_for(min(len(d) for d in fit.values()))
    parts, _ = fold_datasets(fit, fit_folds, seed)
    # every calibration and every score of the stage reads the same batches: made once
    made = {id(p): list(batches_of(p)) for ps in parts.values() for p in ps}
    held_made = {t: list(batches_of(d)) for t, d in held.items()}
    held_batches = held_made.__getitem__
    reference = HeldoutReference(family, experts, held_batches, device, "drift")
    model = copy.deepcopy(merged)
    report, _, _ = calibrate_per_block(make_engine, family, hp, options, {**grid, "alpha": (hp.alpha,)}, model, base,
                                       experts, parts, lambda part: made[id(part)], trial=True)
    schedule = [replace(hp, **entry["hparams"]) for entry in report["blocks"]]
    per_example = {hp.alpha: reference.example_scores(family, model, held_batches)}
    del model
    fit_batches = {t: [b for part in ps for b in made[id(part)]] for t, ps in parts.items()}
    for alpha in grid["alpha"]:
        if alpha != hp.alpha:
            policy = FixedHParams([replace(h, alpha=alpha) for h in schedule])
            engine = make_engine(hp, family, search=True, policy=policy)
            per_example[alpha] = held_out_scores(engine, merged, base, experts, fit_batches, reference, family,
                                                 held_batches)
    return {
        "criterion": "drift", **alpha_verdict(per_example, hp.alpha, options.noise_z), "split": sizes,
        "fit_folds": fit_folds,
        "schedule": [{k: entry["hparams"][k] for k in ("lambda_", "rho")} for entry in report["blocks"]],
        "calibrations": len(per_example), "seconds": time.perf_counter() - started,
    }


def site_stage(make_engine: EngineFactory, family, options: SelectionOptions, hp, grid, merged, base, experts,
               datasets, batches_of, device, seed, site, shard=(0, 1)) -> Dict[str, Any]:
    """``alpha_criterion: site``'s stage: the merged model calibrated on the fit part once per alpha of the grid at
    or above the method's, with the grid's smallest lambda and the method's rho in every block (no per-block search:
    at the least shrinkage rho hardly matters, and the per-block pass after the stage chooses both at the chosen
    alpha), each scored at the held-out feature site. Alphas below the method's are not tried: wherever the offline
    CLIP worlds tried 0.15, it scored below 0.3 on the test labels and at the site (docs/featcal.md). Up to
    ``FEW_EXAMPLES`` examples per task one held-out quarter is too few examples for the noise rule to let the test
    labels' alpha through (docs/featcal.md): there each quarter (``heldout_fraction``) is held out in turn, so every
    example is scored once, at a calibration per alpha and quarter; above, one quarter is held out. ``shard``: (rank,
    world size); with several devices each fit part is shared out and the engine all-reduces the moments, as in the
    per-block pass, so every rank solves the same systems, and every rank scores every held-out example (a forward
    pass each): the ranks choose alike without a collective of their own."""
    started = time.perf_counter()
    splits, sizes, folds = site_splits(datasets, options, seed, shard)
    stage = replace(hp, lambda_=min(grid["lambda_"]))
    alphas = [a for a in grid["alpha"] if a >= hp.alpha]  # grid_for sorts it, the method's alpha among it
    scored: Dict[float, List[Optional[Dict[str, torch.Tensor]]]] = {alpha: [] for alpha in alphas}
    for fit, held in splits:
        fit_made = {t: [b for d in ds for b in batches_of(d)] for t, ds in fit.items()}
        held_made = {t: list(batches_of(d)) for t, d in held.items()}
        site.hold_out(family, experts, held_made.__getitem__, device)
        for alpha in alphas:
            engine = make_engine(replace(stage, alpha=alpha), family, search=True)
            scored[alpha].append(held_out_scores(engine, merged, base, experts, fit_made, site, family,
                                                 held_made.__getitem__))
    per_example = {alpha: pooled(cs) for alpha, cs in scored.items()}
    return {
        "criterion": "site", "measure": site.measure, **alpha_verdict(per_example, hp.alpha, options.noise_z),
        "split": sizes, "folds": folds,
        "stage_hparams": {"lambda_": stage.lambda_, "rho": stage.rho},
        "calibrations": folds * len(alphas), "seconds": time.perf_counter() - started,
    }


def site_splits(datasets, options: SelectionOptions, seed, shard=(0, 1)):
    """The (fit parts, held-out part) pairs that the site scores, each task's examples split alike for every
    candidate: up to ``FEW_EXAMPLES`` examples per task each of ``1 / heldout_fraction`` parts held out in turn
    (``site_parts: auto``), else one ``heldout_fraction``; the sizes for the report; the number of pairs.
    ``shard``: (rank, world size); with several devices each fit part is shared out, the held-out parts are not."""
    rank, world_size = shard
    folds = options.site_folds(min(len(d) for d in datasets.values()))
    if folds > 1:
        held_parts, sizes = fold_datasets(datasets, folds, seed)
        fit_parts = fold_datasets(datasets, folds, seed, shard)[0] if world_size > 1 else held_parts
        splits = [({t: [p for j, p in enumerate(ps) if j != k] for t, ps in fit_parts.items()},
                   {t: ps[k] for t, ps in held_parts.items()}) for k in range(folds)]
    else:
        fit, held, sizes = split_datasets(datasets, options, seed)
        if world_size > 1:
            fit = {t: subset(d, range(rank, len(d), world_size)) for t, d in fit.items()}
        splits = [({t: [d] for t, d in fit.items()}, held)]
    return splits, sizes, folds


def held_out_scores(engine: FeatCalEngine, merged, base, experts, fit_batches, reference, family, held_batches):
    """``reference``'s per-example held-out scores (cosines, or on T5 the experts' probabilities) of a copy of
    ``merged`` that ``engine`` calibrated on ``fit_batches``, or None where that calibration was not finite."""
    model = copy.deepcopy(merged)
    try:
        engine.run(model, base, experts, {t: list(bs) for t, bs in fit_batches.items()})
    except NonFiniteError:
        return None
    return reference.example_scores(family, model, held_batches)


def pooled(parts: Iterable[Optional[Dict[str, torch.Tensor]]]) -> Optional[Dict[str, torch.Tensor]]:
    """Per task, the held-out parts' per-example cosines in one tensor; None as soon as a part is (a calibration that
    was not finite), so a lazy ``parts`` calibrates no further part."""
    taken = []
    for part in parts:
        if part is None:
            return None
        taken.append(part)
    return {t: torch.cat([part[t] for part in taken]) for t in taken[0]}


def alpha_verdict(per_example: Mapping[float, Optional[Dict[str, torch.Tensor]]], method: float,
                  noise_z: float) -> Dict[str, Any]:
    """The best alpha by the mean over tasks of its held-out per-example cosines (None: not finite), and whether it
    is taken: the best against the method's alpha (or, where the method's is the best, against the runner-up),
    paired per example; the method's is kept unless beaten by more than ``noise_z`` standard errors."""
    scores = {f"{a:g}": mean_over_tasks({t: float(v.mean()) for t, v in c.items()}) if c is not None else math.nan
              for a, c in sorted(per_example.items())}
    alphas = {f"{a:g}": a for a in per_example}
    best = alphas[best_of(scores, higher_is_better=True)]
    others = {k: v for k, v in scores.items() if alphas[k] != method and not math.isnan(v)}
    versus = method if best != method else alphas[best_of(others, higher_is_better=True)] if others else None
    margin = margin_se = None
    if versus is not None and per_example[versus] is not None:
        margin, se = paired_difference(per_example[best], per_example[versus])
        margin_se = standard_errors(margin, se)
    kept = best != method and not (margin_se is not None and margin_se > noise_z)  # within the noise, NaN or unpaired
    return {"method_alpha": method, "best": best, "chosen": method if kept else best, "versus": versus,
            "kept": kept, "margin": margin, "margin_se": margin_se, "scores": scores}


# ---- criteria "drift" / "agreement": a calibration per candidate ----------------------------------------------


@torch.no_grad()
def final_states(family: ModelFamily, model: nn.Module, batches, device) -> List[tuple]:
    """Every batch's last-block output (hidden, meta), block by block so that a host or lazy model visits the
    device one block at a time."""
    states = []
    with on_device(family.stem_modules(model), device):
        for inputs in batches:
            states.append(family.embed(model, family.inputs_to(inputs, device)))
    for index, block in enumerate(family.blocks(model)):
        with on_device(family.stem_modules(model), device):
            states = [family.enter_block(model, index, h, m) for h, m in states]
        with on_device([block], device):
            states = [(family.run_block(block, h, m), m) for h, m in states]
    return states


@torch.no_grad()
def predictions(family: ModelFamily, model: nn.Module, states, device) -> Optional[List[torch.Tensor]]:
    """The family head's logits for each batch of final states, or None where the family has no head."""
    modules = family.head_modules(model)
    if modules is None:
        return None
    with on_device(modules, device):
        return [family.predict(model, h, m) for h, m in states]


class HeldoutReference:
    """The experts' held-out last-block outputs and predictions: independent of every hyperparameter, so computed
    once for the whole search."""

    def __init__(self, family, experts, held_batches: Callable[[str], Any], device, criterion: str):
        self.device = device
        self.states = {t: final_states(family, e, held_batches(t), device) for t, e in experts.items()}
        self.argmax = None
        if criterion == "agreement":
            logits = {t: predictions(family, experts[t], self.states[t], device) for t in experts}
            if all(v is not None for v in logits.values()):
                self.argmax = {t: [x.argmax(-1) for x in v] for t, v in logits.items()}
        self.criterion = criterion if criterion != "agreement" or self.argmax is not None else "drift"

    def example_scores(self, family, model, held_batches) -> Dict[str, torch.Tensor]:
        """Per task, each held-out example's mean cosine of ``model``'s last-block output to the expert's."""
        out = {}
        for task, reference in self.states.items():
            states = final_states(family, model, held_batches(task), self.device)
            out[task] = torch.cat([example_cosines(h, r, family.valid_token_mask(m, h)).cpu()
                                   for (h, m), (r, _) in zip(states, reference)])
        return out

    def score(self, family, model, held_batches) -> Dict[str, float]:
        per_task = {}
        for task, reference in self.states.items():
            states = final_states(family, model, held_batches(task), self.device)
            if self.criterion == "agreement":
                meter = AgreementMeter()
                for (h, m), logits, expert in zip(states, predictions(family, model, states, self.device), self.argmax[task]):
                    meter.update(logits, expert, family.valid_token_mask(m, h))
                per_task[task] = meter.result()
            else:
                meter = DriftMeter()
                for (h, m), (r, _) in zip(states, reference):
                    meter.update(h, r, family.valid_token_mask(m, h))
                per_task[task] = meter.result()["cosine"]
        return per_task


def select_by_runs(make_engine: EngineFactory, family_with, options: SelectionOptions, hp, grid, merged, base, experts,
                   splits, device, site=None):
    """The chosen (hparams, family options) after a calibration per candidate and split, and the search's report.
    ``splits``: (fit batches: () -> task -> batches, held-out batches: task -> batches) pairs; ``drift`` and
    ``agreement`` score one; criterion ``site`` pools every pair's held-out examples (``site_splits``), scored at
    ``site``'s feature site (``alpha_site``)."""
    plain_family = family_with({})
    if options.criterion == "site":
        references = [site.fresh().hold_out(plain_family, experts, held, device) for _, held in splits]
    else:
        references = [HeldoutReference(plain_family, experts, splits[0][1], device, options.criterion)]
    start = {"lambda_": hp.lambda_, "rho": hp.rho, "alpha": hp.alpha}
    if PATCH_WEIGHT in grid:
        start[PATCH_WEIGHT] = plain_family.option_values[PATCH_WEIGHT]
    stages = coordinate_stages(grid) if options.search == "coordinate" else [list(grid)]
    scores: Dict[str, Dict[str, Any]] = {}
    points: Dict[str, Candidate] = {}
    rows: Dict[str, Optional[Dict[str, torch.Tensor]]] = {}  # criterion site: each point's per-example cosines

    def score(candidate: Candidate) -> None:
        key = candidate_key(candidate)
        if key in scores:  # the stage's starting point was scored by the previous stage
            return
        family = family_with({PATCH_WEIGHT: candidate[PATCH_WEIGHT]} if PATCH_WEIGHT in candidate else {})
        per_task = {t: float("nan") for t in experts}
        if options.criterion == "site":
            rows[key] = pooled(
                held_out_scores(make_engine(with_candidate(hp, candidate), family, search=True), merged, base,
                                experts, fit_batches(), reference, family, held_batches)
                for (fit_batches, held_batches), reference in zip(splits, references))
            if rows[key] is not None:
                per_task = {t: float(c.mean()) for t, c in rows[key].items()}
        else:
            (fit_batches, held_batches), = splits
            model = copy.deepcopy(merged)
            try:
                make_engine(with_candidate(hp, candidate), family, search=True).run(model, base, experts,
                                                                                    fit_batches())
                per_task = references[0].score(family, model, held_batches)
            except NonFiniteError:
                pass
            del model
        scores[key], points[key] = {"score": mean_over_tasks(per_task), "per_task": per_task}, candidate

    best = dict(start)
    for keys in stages:
        stage = stage_candidates(grid, keys, best) if options.search == "coordinate" else all_candidates(grid)
        for candidate in stage:
            score(candidate)
        in_stage = {candidate_key(c): scores[candidate_key(c)]["score"] for c in stage}
        best = next(c for c in stage if candidate_key(c) == best_of(in_stage, higher_is_better=True))
    lambda_rule = None
    if options.keep_method_lambda:
        rival = {**best, "lambda_": hp.lambda_}
        score(rival)
        lambda_rule = lambda_verdict(rows, best, rival, options.noise_z)
        best = rival if lambda_rule["kept"] else best
    search = {"criterion_used": references[0].criterion, "candidates": scores,
              "calibrations": len(scores) * len(splits)}
    if options.criterion == "site":
        search.update(alpha={**site_alpha_margin(points, scores, rows, hp.alpha), "measure": references[0].measure})
    if lambda_rule is not None:
        search["lambda"] = lambda_rule
    return best, search


def lambda_verdict(rows: Mapping[str, Optional[Dict[str, torch.Tensor]]], best: Candidate, method: Candidate,
                   noise_z: float) -> Dict[str, Any]:
    """Criterion site's do-no-harm rule on lambda (``keep_method_lambda``): ``method`` (the best point with the
    method's lambda) is taken unless ``best`` beats it by more than ``noise_z`` standard errors, paired per held-out
    example; a method's point that did not calibrate finitely is not. Between lambdas a decade either side of the
    text world's paper value the site's measure did not resolve test-label gaps of 0.6 points (docs/featcal.md)."""
    out = {"method_lambda": method["lambda_"], "best": best["lambda_"], "kept": False, "margin": None,
           "margin_se": None}
    ours = rows[candidate_key(method)]
    if best["lambda_"] == method["lambda_"] or ours is None:
        return out
    margin, se = paired_difference(rows[candidate_key(best)], ours)
    z = standard_errors(margin, se)
    return {**out, "kept": not z > noise_z, "margin": margin, "margin_se": z}


def standard_errors(margin: float, se: float) -> float:
    """``margin`` in standard errors; a zero standard error leaves only its sign."""
    return margin / se if se > 0 else (0.0 if margin == 0 else math.copysign(math.inf, margin))


def site_alpha_margin(points: Mapping[str, Candidate], scores: Mapping[str, Mapping[str, Any]],
                      rows: Mapping[str, Optional[Dict[str, torch.Tensor]]], method: float) -> Dict[str, Any]:
    """How clear criterion site's alpha was, for the report and the log: each alpha's best scored point, the best
    against the method's alpha's best (or, where that is the best, against the runner-up), paired per held-out
    example (``alpha_verdict`` with no noise rule: the choice stays the best point). A rule that kept the method's
    alpha within ``noise_z`` (2) standard errors was measured and not kept: it kept 0.3 at 32 examples per task where
    the larger alpha it set aside scored up to 3.4 points higher on the test labels (docs/featcal.md)."""
    by_alpha: Dict[float, str] = {}
    for key, point in points.items():
        alpha = point["alpha"]
        if math.isfinite(scores[key]["score"]) and (alpha not in by_alpha
                                                    or scores[key]["score"] > scores[by_alpha[alpha]]["score"]):
            by_alpha[alpha] = key
    points_by_alpha = {f"{a:g}": k for a, k in sorted(by_alpha.items())}
    if method not in by_alpha:  # a grid.alpha without the method's, or the method's never finite: nothing to weigh
        return {"criterion": "site", "points": points_by_alpha}
    return {"criterion": "site", **alpha_verdict({a: rows[k] for a, k in by_alpha.items()}, method, -math.inf),
            "points": points_by_alpha}


# ---- the whole search, then the final calibration -------------------------------------------------------------


def auto_calibrate(make_engine: EngineFactory, family_with, options: SelectionOptions, hp: FeatCalHParams,
                   merged, base, experts, datasets: Mapping[str, Any], batches_of: Callable[[Any], Any], device,
                   shard=(0, 1), site=None):
    """Choose, and calibrate ``merged`` in place on all of ``datasets`` with the choice; return the engine's report
    with an ``auto_select`` entry (grid, scores, choice, fold or split sizes, seconds and the search's cost
    multiple). ``datasets``: each task's calibration examples, all of them; ``shard``: (rank, world size) of this
    device, which calibrates on its share of each fold (criterion ``objective``; the others run on one device);
    ``site``: ``alpha_site``'s, which criterion or ``alpha_criterion`` ``site`` needs."""
    family = family_with({})
    if options.reads_site and site is None:
        raise ValueError("auto_select criterion or alpha_criterion 'site' needs the family's feature site (alpha_site)")
    fallback = None
    if options.criterion == "site" and hp.num_calibration_examples < site.fewest_measured:
        fallback = few_examples_fallback(options, hp.num_calibration_examples, site)
        if fallback is not None:
            options = options.fallback()
    seed = hp.seed if options.seed is None else options.seed
    grid = options.grid_for(family.option_values, hp)
    folds = options.folds_for(hp.num_calibration_examples)
    alpha_stage = site_parts = None
    if options.criterion == "objective":
        if options.alpha_criterion != "none":
            alpha_stage = choose_alpha(make_engine, family, options, hp, grid, merged, base, experts, datasets,
                                       batches_of, device, seed, site if options.alpha_criterion == "site" else None,
                                       shard)
            hp = replace(hp, alpha=alpha_stage["chosen"])
        parts, sizes = fold_datasets(datasets, folds, seed, shard)
        searched = {**grid, "alpha": (hp.alpha,)} if alpha_stage is not None else grid
        report, choice, search = calibrate_per_block(make_engine, family, hp, options, searched, merged, base,
                                                     experts, parts, batches_of)
        if alpha_stage is not None:
            search["search_seconds"] += alpha_stage["seconds"]
            search["calibrations"] += alpha_stage["calibrations"]
    else:
        if options.criterion == "site":
            parts, sizes, site_parts = site_splits(datasets, options, seed)
        else:
            fit, held, sizes = split_datasets(datasets, options, seed)
            parts = [({t: [d] for t, d in fit.items()}, held)]
        started = time.perf_counter()
        splits = [(lambda fit=fit: {t: [b for d in ds for b in batches_of(d)] for t, ds in fit.items()},
                   lambda t, held=held: batches_of(held[t])) for fit, held in parts]
        best, search = select_by_runs(make_engine, family_with, options, hp, grid, merged, base, experts, splits,
                                      device, site)
        search_seconds = time.perf_counter() - started
        chosen_family = family_with({PATCH_WEIGHT: best[PATCH_WEIGHT]} if PATCH_WEIGHT in best else {})
        choice = {"global": dict(best)}
        final_started = time.perf_counter()
        report = make_engine(with_candidate(hp, best), chosen_family).run(
            merged, base, experts, {t: batches_of(d) for t, d in datasets.items()}
        )
        search.update(search_seconds=search_seconds, final_seconds=time.perf_counter() - final_started)
    search_seconds, final_seconds = search["search_seconds"], search["final_seconds"]
    objective = options.criterion == "objective"
    report["auto_select"] = {
        "criterion": options.criterion,
        **({"fallback": fallback} if fallback is not None else {}),
        "search": f"per_block ({options.search})" if objective else options.search,
        **({"folds": folds, "noise_z": options.noise_z, "widen": options.widen,
            "least_shrinkage": options.least_shrinkage, "alpha_criterion": options.alpha_criterion} if objective
           else {"heldout_fraction": options.heldout_fraction}),
        **({"site_parts": site_parts} if site_parts is not None else {}),
        **({"alpha": alpha_stage} if alpha_stage is not None else {}),
        "seed": seed,
        "grid": {k: list(v) for k, v in grid.items()},
        "folds_per_task" if objective else "split": sizes,
        "choice": choice,
        **search,
        "cost_multiple": search_seconds / final_seconds if final_seconds > 0 else math.nan,
    }
    log.info("FeatCal auto_select (%s): %s; %.1fs = %.2f x the calibration without choice (%d calibration(s))",
             options.criterion, describe_choice(report["auto_select"]), search_seconds,
             report["auto_select"]["cost_multiple"], search["calibrations"])
    return report


def few_examples_fallback(options: SelectionOptions, num_examples: int, site) -> Optional[Dict[str, Any]]:
    """Below the examples per task where the site's measure was measured to beat criterion objective: with
    ``few_examples: objective`` the report's ``fallback`` entry (criterion objective then chooses, ``fallback()``), with
    ``site`` None (criterion site runs anyway). The log says which."""
    below = (f"FeatCal auto_select criterion site with {num_examples} calibration examples per task: below "
             f"{site.fewest_measured} it was {site.below_it} (docs/featcal.md)")
    if options.few_examples == "site":
        log.warning("%s; it runs anyway (auto_select.few_examples=site)", below)
        return None
    log.warning("%s; criterion objective chooses instead, with its defaults (auto_select.few_examples=site runs "
                "criterion site anyway)", below)
    return {"from": "site", "to": "objective", "num_calibration_examples": num_examples,
            "fewest_measured": site.fewest_measured, "measure": site.measure}


def describe_choice(auto: Mapping[str, Any]) -> str:
    """One line: the values chosen (per span of blocks), how clear each block's choice was, and where a choice sat
    at a grid's edge or kept the method's values."""
    if "fallback" in auto:
        rest = {k: v for k, v in auto.items() if k != "fallback"}
        return (f"criterion objective in place of site (fewer than {auto['fallback']['fewest_measured']} examples per "
                f"task): {describe_choice(rest)}")
    if "global" in auto["choice"]:
        line = "chose " + ", ".join(f"{k.rstrip('_')} {v:g}" for k, v in auto["choice"]["global"].items())
        scores = {k: c["score"] for k, c in auto.get("candidates", {}).items() if math.isfinite(c["score"])}
        chosen = candidate_key(auto["choice"]["global"])
        others = {k: v for k, v in scores.items() if k != chosen}
        if chosen in scores and others:  # every criterion of this path is higher-is-better
            runner = max(others, key=others.get)
            lead = scores[chosen] - scores[runner]  # below 0 where a noise rule kept the method's lambda
            line += (f" ({auto.get('criterion_used', auto['criterion'])} {scores[chosen]:.4f}; "
                     + (f"runner-up {_values(runner)} {lead:.4f} behind)" if lead >= 0 else
                        f"best {_values(runner)} {-lead:.4f} ahead)"))
        if auto.get("lambda", {}).get("margin_se") is not None:
            line += f", {_lambda_line(auto['lambda'])}"
        return line + (f", {_alpha_line(auto['alpha'])}" if "margin_se" in auto.get("alpha", {}) else "")
    blocks = auto["blocks"]
    if not blocks:
        return "no block to choose for"
    spans: List[List[Any]] = []
    for entry in blocks:
        if spans and spans[-1][0] == entry["chosen"] and spans[-1][2] == entry["block"] - 1:
            spans[-1][2] = entry["block"]
        else:
            spans.append([entry["chosen"], entry["block"], entry["block"]])
    shown = "; ".join(f"{_values(key)} in block{'s' if a != b else ''} {a if a == b else f'{a}-{b}'}"
                      for key, a, b in spans)
    z = [e["margin_se"] for e in blocks if "margin_se" in e and e["margin"] >= 0]
    parts = [shown]
    if "alpha" in auto:
        parts.append(_alpha_line(auto["alpha"]))
    elif auto.get("alpha_criterion") == "none" and len(auto.get("grid", {}).get("alpha", ())) <= 1:
        # the per-block objective cannot rank alpha (it scores against the experts' own features), so a line that
        # names alpha beside the chosen values must not read as if alpha had been chosen too
        parts.append("alpha the method's, not searched (auto_select.alpha_criterion none; criterion site chooses it "
                     "with lambda on CLIP, OpenCLIP and FLAN-T5, in memory: featcal/auto_clip_site, "
                     "featcal/auto_flan_t5_site)")
    if z:
        unclear = sum(1 for v in z if v < auto.get("noise_z", 2.0))
        parts.append(f"runner-up {min(z):.1f}-{max(z):.1f} standard errors behind"
                     + (f" (within {auto.get('noise_z', 2.0):g} in {unclear} of {len(z)} blocks)" if unclear else ""))
    relaxed = [e["block"] for e in blocks if "held_out_best_lambda" in e]
    if relaxed:
        parts.append(f"lambda the smallest within the noise of the held-out best in block(s) {_spans(relaxed)}")
    kept = [e["block"] for e in blocks if e.get("kept")]
    if kept:
        parts.append(f"the method's values kept within the noise in block(s) {_spans(kept)}")
    edges = [e["block"] for e in blocks if e.get("edge")]
    if edges:
        kinds = sorted({k for e in blocks for k in e.get("edge", [])})
        parts.append(f"at a grid edge in block(s) {_spans(edges)} ({'; '.join(kinds)})")
    return ", ".join(parts)


def _alpha_line(stage: Mapping[str, Any]) -> str:
    """How the alpha stage chose: its held-out cosine's margin, in standard errors, over the method's alpha (or, where
    the method's is the best, its margin over the runner-up)."""
    method, best, versus, z = stage["method_alpha"], stage["best"], stage["versus"], stage["margin_se"]
    measure = "held-out drift" if stage["criterion"] == "drift" else stage["measure"]
    if versus is None:
        return f"alpha {method:g}, the method's (no other alpha scored)"
    if best == method:
        return f"alpha {method:g}, the method's, the closest to the experts by {measure} ({z:.1f} standard " \
               f"errors ahead of {versus:g})"
    if stage["kept"]:
        return f"the method's alpha {method:g} kept: {best:g} ahead on {measure} by {z:.1f} standard errors, " \
               f"within the noise"
    return f"alpha {best:g} by {measure}, {z:.1f} standard errors ahead of the method's {method:g}"


def _lambda_line(rule: Mapping[str, Any]) -> str:
    """How criterion site's do-no-harm rule on lambda went (``lambda_verdict``)."""
    method, best, z = rule["method_lambda"], rule["best"], rule["margin_se"]
    if not rule["kept"]:
        return f"lambda {best:g}, {z:.1f} standard errors ahead of the method's {method:g}"
    if z <= 0:
        return f"the method's lambda {method:g}, {-z:.1f} standard errors ahead of {best:g}"
    return f"the method's lambda {method:g} kept: {best:g} ahead by {z:.1f} standard errors, within the noise"


def _values(key: str) -> str:
    return ", ".join(f"{k.rstrip('_')} {v}" for k, v in (part.split("=") for part in key.split(",")))


def _spans(indices: List[int]) -> str:
    out: List[List[int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
