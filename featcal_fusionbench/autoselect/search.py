"""``method.auto_select``: the search for lambda / rho / alpha without labels, then the final calibration (the
options and grids are in ``options``, the per-block policy in ``policy``, the math in ``core``).

Every task's calibration examples are split into a fit part and a held-out part (inputs only; no label is read).

- criterion ``objective``: the calibration itself, in one pass over the model (in memory or out of core alike). At
  each block, the fit moments are accumulated once and folded once per distinct alpha; every candidate
  (lambda, rho, alpha) is a closed-form solve on them, scored on the block's held-out moments
  (``policy.HeldoutSelection``); the block is then solved with the best on ALL of each task's calibration examples,
  loaded (or written), and every stream advances through it, so the next block chooses on the chosen prefix
  (greedy, per block). ``search_seconds`` is the time spent choosing (the part collections and candidate solves).
- criteria ``drift`` / ``agreement``: one calibration of a copy of the merged model on the fit part per candidate
  (coordinate or full grid), scored on the held-out part's last-block outputs against the experts'. The experts'
  held-out outputs do not depend on the hyperparameters and are computed once. Then the final calibration runs on
  ALL calibration examples with the chosen values. They hold the merged model whole (a copy per candidate).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from ..core.hparams import FeatCalHParams
from ..core.meters import AgreementMeter, DriftMeter
from ..core.moments import NonFiniteError
from ..core.sampling import heldout_split, subset
from ..engine.loop import FeatCalEngine
from ..families import ModelFamily
from ..models.residency import on_device
from .policy import HeldoutSelection
from .options import (
    PATCH_WEIGHT,
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


def calibrate_per_block(make_engine: EngineFactory, family, hp, grid, merged, base, experts, fit_batches,
                        held_batches):
    """Calibrate ``merged`` in place, each block's values chosen on held-out moments and the block then solved with
    them on all batches (``policy.HeldoutSelection``); the engine's report and the search's."""
    candidates = all_candidates({k: v for k, v in grid.items() if k != PATCH_WEIGHT})
    selection = HeldoutSelection(candidates)
    report = make_engine(hp, family, policy=selection).run(merged, base, experts, fit_batches, held_batches)
    fixed = candidate_key({k: getattr(hp, k) for k in ("lambda_", "rho", "alpha")})
    per_block = [e["selection"]["chosen"] if "selection" in e else fixed for e in report["blocks"]]
    blocks = [{"block": e["block"], **e["selection"]} for e in report["blocks"] if "selection" in e]
    search_seconds = sum(e.get("selection_seconds", 0.0) for e in report["blocks"])
    search = {"candidates": [candidate_key(c) for c in candidates], "blocks": blocks, "solves": selection.solves,
              "calibrations": 1, "search_seconds": search_seconds,
              "final_seconds": report["seconds"] - search_seconds}
    return report, {"per_block": per_block}, search


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
                   fit_batches, held_batches, device):
    """The chosen (hparams, family options) after a calibration per candidate, and the search's report."""
    reference = HeldoutReference(family_with({}), experts, held_batches, device, options.criterion)
    start = {"lambda_": hp.lambda_, "rho": hp.rho, "alpha": hp.alpha}
    if PATCH_WEIGHT in grid:
        start[PATCH_WEIGHT] = family_with({}).option_values[PATCH_WEIGHT]
    stages = coordinate_stages(grid) if options.search == "coordinate" else [list(grid)]
    scores: Dict[str, Dict[str, Any]] = {}
    best = dict(start)
    for keys in stages:
        stage = stage_candidates(grid, keys, best) if options.search == "coordinate" else all_candidates(grid)
        for candidate in stage:
            key = candidate_key(candidate)
            if key in scores:  # the stage's starting point was scored by the previous stage
                continue
            family = family_with({PATCH_WEIGHT: candidate[PATCH_WEIGHT]} if PATCH_WEIGHT in candidate else {})
            model = copy.deepcopy(merged)
            try:
                make_engine(with_candidate(hp, candidate), family, search=True).run(model, base, experts, fit_batches())
                per_task = reference.score(family, model, held_batches)
            except NonFiniteError:
                per_task = {t: float("nan") for t in experts}
            scores[key] = {"score": mean_over_tasks(per_task), "per_task": per_task}
            del model
        in_stage = {candidate_key(c): scores[candidate_key(c)]["score"] for c in stage}
        best = next(c for c in stage if candidate_key(c) == best_of(in_stage, higher_is_better=True))
    return best, {"criterion_used": reference.criterion, "candidates": scores, "calibrations": len(scores)}


# ---- the whole search, then the final calibration -------------------------------------------------------------


def auto_calibrate(make_engine: EngineFactory, family_with, options: SelectionOptions, hp: FeatCalHParams,
                   merged, base, experts, datasets: Mapping[str, Any], batches_of: Callable[[Any], Any], device):
    """Choose, and calibrate ``merged`` in place on all of ``datasets`` with the choice; return the engine's report
    with an ``auto_select`` entry (grid, scores, choice, split sizes, seconds and the search's cost multiple)."""
    family = family_with({})
    seed = hp.seed if options.seed is None else options.seed
    grid = options.grid_for(family.option_values, hp)
    fit, held, sizes = split_datasets(datasets, options, seed)
    if options.criterion == "objective":
        report, choice, search = calibrate_per_block(
            make_engine, family, hp, grid, merged, base, experts,
            {t: batches_of(d) for t, d in fit.items()}, {t: batches_of(d) for t, d in held.items()},
        )
    else:
        started = time.perf_counter()
        best, search = select_by_runs(
            make_engine, family_with, options, hp, grid, merged, base, experts,
            lambda: {t: batches_of(d) for t, d in fit.items()}, lambda t: batches_of(held[t]), device,
        )
        search_seconds = time.perf_counter() - started
        chosen_family = family_with({PATCH_WEIGHT: best[PATCH_WEIGHT]} if PATCH_WEIGHT in best else {})
        choice = {"global": dict(best)}
        final_started = time.perf_counter()
        report = make_engine(with_candidate(hp, best), chosen_family).run(
            merged, base, experts, {t: batches_of(d) for t, d in datasets.items()}
        )
        search.update(search_seconds=search_seconds, final_seconds=time.perf_counter() - final_started)
    search_seconds, final_seconds = search["search_seconds"], search["final_seconds"]
    report["auto_select"] = {
        "criterion": options.criterion,
        "search": options.search if options.criterion != "objective" else "per_block",
        "heldout_fraction": options.heldout_fraction,
        "seed": seed,
        "grid": {k: list(v) for k, v in grid.items()},
        "split": sizes,
        "choice": choice,
        **search,
        "cost_multiple": search_seconds / final_seconds if final_seconds > 0 else math.nan,
    }
    log.info(
        "FeatCal auto_select (%s): chose %s in %.2fs = %.2f x the calibration without choice (%d calibration(s))",
        options.criterion, choice, search_seconds, report["auto_select"]["cost_multiple"], search["calibrations"],
    )
    return report
