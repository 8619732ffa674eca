"""The per-block label-free choice (criterion ``objective``) as the loop's hyperparameter policy: cross-fitting.

Each task's calibration examples are in K parts (folds). At each block every part's moments are collected once and
folded into that part's solve sums and held-out objective sums (``core.objective.HeldoutObjective``). A candidate
(lambda, rho, alpha) is solved K times, each time on all parts but one (their sums averaged) and scored on the part
left out; its score is the sum over the K parts, and the K per-part scores give the noise of a difference between
two candidates (paired over the parts). The search (``Search``): lambda first, on the grid at the method's rho and
alpha, the grid widened past an edge that wins (down to the numerical floor, up to ``LAMBDA_CAP``); then rho (x alpha
when a grid of alphas is given) at that lambda, rho widened likewise. The choice: the best score, unless the
method's own values (or the best lambda at the method's rho and alpha) score within ``noise_z`` standard errors of
it, which are then kept: the held-out evidence has to beat the configuration by more than its own noise. The loop
then solves the block with the choice on all of each task's batches and loads it, so the next block chooses on the
chosen prefix (greedy, per block), in the one pass that calibrates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.block_sums import BlockSums
from ..core.hparams import FeatCalHParams
from ..core.moments import NonFiniteError
from ..core.objective import HeldoutObjective
from ..engine.step import BlockStep, TaskMoments
from .options import Candidate, candidate_key, with_candidate

#: lambda beyond which a solution is the anchor to every digit that matters (each task's Gram has unit norm)
LAMBDA_CAP = 1e4
#: how far rho is widened past the grid, by the grid's own step (the paper's values lie in 0.5 .. 2.2)
RHO_BOUNDS = (0.0, 4.0)


@dataclass(frozen=True)
class Search:
    """What a block's choice tries: ``lambdas`` (at the method's rho and alpha) then ``rhos`` x ``alphas`` at the
    chosen lambda (``coordinate``), or every combination at once (``grid``); ``floor``: the smallest lambda worth
    solving (below it the ridge is under the moments' own rounding); ``widen``: extend lambda and rho past a
    winning edge; ``noise_z``: how many standard errors the evidence must beat the method's values by."""

    lambdas: Tuple[float, ...]
    rhos: Tuple[float, ...]
    alphas: Tuple[float, ...]
    mode: str = "coordinate"
    floor: float = 1e-8
    widen: bool = True
    noise_z: float = 2.0


class CrossFitSelection:
    """An ``engine.policy.HParamPolicy`` whose every block chooses by cross-fitting over ``folds`` parts;
    ``solves`` counts the candidate solves over the whole run."""

    needs_parts = True

    def __init__(self, search: Search, folds: int):
        self.search = search
        self.folds = folds
        self.solves = 0

    def check(self, num_blocks: int) -> None:
        pass  # any number of blocks

    def for_block(self, index: int, hparams: FeatCalHParams) -> "CrossFitChoice":
        return CrossFitChoice(self, hparams)


def average_of(parts: Sequence[BlockSums]) -> BlockSums:
    """The mean of several parts' solve sums (each entry is linear in the tasks' moments): the sums of the parts
    but one, as one part's worth against lambda."""
    out = BlockSums()
    weight = 1.0 / len(parts)
    for sums in parts:
        for store in ("gram", "mean_cal", "target", "bias_target"):
            mine = getattr(out, store)
            for key, value in getattr(sums, store).items():
                if key in mine:
                    mine[key].add_(value, alpha=weight)
                else:
                    mine[key] = value * weight
        for key, value in sums.omega.items():
            out.omega[key] += weight * value
        for name, entry in sums.norm.items():
            mine = out.norm.setdefault(name, {})
            for key, value in entry.items():
                if key in mine:
                    mine[key].add_(value, alpha=weight)
                else:
                    mine[key] = value * weight
        out.num_tasks += weight * sums.num_tasks
    return out


class CrossFitChoice:
    """One block's choice (an ``engine.policy.BlockSelection``); its ``report`` records the choice, the runner-up,
    the margin between them and every candidate's score."""

    def __init__(self, policy: CrossFitSelection, hparams: FeatCalHParams):
        self.policy = policy
        self.hparams = hparams
        # the solve's sums depend on alpha (its targets): one set per part and alpha searched
        alphas = sorted({hparams.alpha, *policy.search.alphas})
        self.parts = {alpha: [BlockSums() for _ in range(policy.folds)] for alpha in alphas}
        self.heldout = [HeldoutObjective() for _ in range(policy.folds)]
        self.report: Dict[str, Any] = {}

    def add(self, part: int, step: BlockStep, moments: TaskMoments, expert_sites) -> None:
        for alpha, parts in self.parts.items():
            step.fold(moments, expert_sites, parts[part], with_candidate(self.hparams, {"alpha": alpha}))
        step.fold(moments, expert_sites, self.heldout[part], self.hparams)
        held = moments.nbytes + sum(h.nbytes() for h in self.heldout)
        held += sum(s.nbytes() for parts in self.parts.values() for s in parts)
        step.peak_bytes = max(step.peak_bytes, held)  # every part's sums, beside one task part's moments

    # ---- scoring ----------------------------------------------------------------------------------------------

    def _score(self, step: BlockStep, candidates: List[Candidate], per_part: Dict[str, List[float]]) -> None:
        """Every new candidate's score on each part (solved on the others), into ``per_part``."""
        todo = list({candidate_key(c): c for c in candidates if candidate_key(c) not in per_part}.values())
        if not todo:
            return
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        scores = {candidate_key(c): [] for c in todo}
        for k in range(self.policy.folds):
            held = self.heldout[k]
            for alpha in sorted({c["alpha"] for c in todo}):
                # the parts but one, for one alpha at a time: a single set of fit sums beside the parts
                fit = average_of([p for j, p in enumerate(self.parts[alpha]) if j != k])
                self._score_fold(step, fit, held, [c for c in todo if c["alpha"] == alpha], current, scores)
                del fit
        per_part.update(scores)

    def _score_fold(self, step, fit, held, candidates, current, scores) -> None:
        for candidate in candidates:
            terms: List[float] = []
            try:
                step.solve(fit, with_candidate(self.hparams, candidate),
                           visit=lambda name, params: terms.append(held.site(name, {**current[name], **params})))
            except NonFiniteError:
                terms = [math.nan]  # a candidate whose solve overflows is never chosen
            self.policy.solves += 1
            scores[candidate_key(candidate)].append(sum(terms))

    def _uncalibrated(self, step: BlockStep) -> List[float]:
        """Each part's held-out score of the block as it is (the merged values): what calibrating gains is
        measured from it."""
        sites = step.plan.sites
        return [sum(held.site(n, {"weight": s.weight, "bias": s.bias}) for n, s in sites.items())
                for held in self.heldout]

    # ---- the search and the choice ------------------------------------------------------------------------------

    def choose(self, step: BlockStep) -> FeatCalHParams:
        search, hp = self.policy.search, self.hparams
        reference = {"lambda_": hp.lambda_, "rho": hp.rho, "alpha": hp.alpha}
        per_part: Dict[str, List[float]] = {}
        total = lambda c: _total(per_part[candidate_key(c)])  # noqa: E731
        widened: Dict[str, List[float]] = {}
        if search.mode == "grid":
            stage = [{"lambda_": lam, "rho": rho, "alpha": alpha}
                     for lam in search.lambdas for rho in search.rhos for alpha in search.alphas]
            self._score(step, [reference, *stage], per_part)
            best = min(stage, key=total)
            best = self._widen_lambda(step, per_part, best, search.lambdas, widened)
        else:
            stage = [{**reference, "lambda_": lam} for lam in search.lambdas]
            self._score(step, [reference, *stage], per_part)
            best = min(stage, key=total)
            best = self._widen_lambda(step, per_part, best, search.lambdas, widened)
            stage = [{**best, "rho": rho, "alpha": alpha} for rho in search.rhos for alpha in search.alphas]
            self._score(step, stage, per_part)
            best = min([best, *stage], key=total)
            best = self._widen_rho(step, per_part, best, search.rhos, widened)
        chosen, kept = self._keep_within_noise(per_part, best, reference)
        self.report = {"selection": self._summary(per_part, chosen, kept, widened, search, step)}
        self.parts = self.heldout = None
        return with_candidate(hp, chosen)

    def _widen_lambda(self, step, per_part, best: Candidate, grid: Sequence[float], widened) -> Candidate:
        """Past a winning edge of the lambda grid, a decade at a time, while the new value wins."""
        search = self.policy.search
        if not search.widen:
            return best
        for factor, stop in ((0.1, lambda v: v < search.floor), (10.0, lambda v: v > LAMBDA_CAP)):
            edge = min(grid) if factor < 1 else max(grid)
            while best["lambda_"] == edge:
                value = edge * factor
                if stop(value):
                    break
                candidate = {**best, "lambda_": value}
                self._score(step, [candidate], per_part)
                widened.setdefault("lambda_", []).append(value)
                edge = value
                if _total(per_part[candidate_key(candidate)]) < _total(per_part[candidate_key(best)]):
                    best = candidate
        return best

    def _widen_rho(self, step, per_part, best: Candidate, grid: Sequence[float], widened) -> Candidate:
        search = self.policy.search
        if not search.widen or len(grid) < 2:
            return best
        step_size = min(b - a for a, b in zip(sorted(grid), sorted(grid)[1:]))
        for direction in (-1.0, 1.0):
            edge = min(grid) if direction < 0 else max(grid)
            while best["rho"] == edge:
                value = round(edge + direction * step_size, 10)
                if not RHO_BOUNDS[0] <= value <= RHO_BOUNDS[1]:
                    break
                candidate = {**best, "rho": value}
                self._score(step, [candidate], per_part)
                widened.setdefault("rho", []).append(value)
                edge = value
                if _total(per_part[candidate_key(candidate)]) < _total(per_part[candidate_key(best)]):
                    best = candidate
        return best

    def _keep_within_noise(self, per_part, best: Candidate, reference: Candidate) -> Tuple[Candidate, Optional[str]]:
        """The method's own values where the best does not beat them by more than ``noise_z`` standard errors; else
        the best lambda at the method's rho and alpha, likewise; else the best."""
        z = self.policy.search.noise_z
        for kept, candidate in (("method", reference), ("method's rho and alpha", {**reference, "lambda_": best["lambda_"]})):
            key = candidate_key(candidate)
            if key == candidate_key(best):
                return best, None
            if key in per_part:
                margin, error = _difference(per_part[key], per_part[candidate_key(best)])
                if math.isfinite(margin) and margin <= z * error:
                    return candidate, kept
        return best, None

    def _summary(self, per_part, chosen, kept, widened, search: Search, step) -> Dict[str, Any]:
        key = candidate_key(chosen)
        totals = {k: _total(v) for k, v in per_part.items()}
        others = [k for k in totals if k != key and math.isfinite(totals[k])]
        runner = min(others, key=totals.get) if others else None
        gain = _total(self._uncalibrated(step)) - totals[key]
        out: Dict[str, Any] = {"chosen": key, "scores": totals, "folds": self.policy.folds, "heldout_gain": gain}
        if runner is not None:
            margin, error = _difference(per_part[runner], per_part[key])
            out.update(runner_up=runner, margin=margin, margin_relative=margin / gain if gain > 0 else math.nan,
                       margin_se=margin / error if error > 0 else math.inf)
        if kept:
            out["kept"] = kept
        lam = chosen["lambda_"]
        grid_lambdas = [*search.lambdas, *widened.get("lambda_", [])]
        edges = []
        if lam == min(grid_lambdas) and lam * 0.1 < search.floor:
            edges.append("lambda at the numerical floor")
        elif lam == min(grid_lambdas):
            edges.append("lambda at the grid's low edge")
        if lam == max(grid_lambdas):
            edges.append("lambda at the grid's high edge")
        grid_rhos = [*search.rhos, *widened.get("rho", [])]
        if len(grid_rhos) > 1 and chosen["rho"] in (min(grid_rhos), max(grid_rhos)):
            edges.append(f"rho at the grid's {'low' if chosen['rho'] == min(grid_rhos) else 'high'} edge")
        if edges:
            out["edge"] = edges
        if widened:
            out["widened"] = widened
        return out


def _total(values: Sequence[float]) -> float:
    return float(sum(values))


def _difference(a: Sequence[float], b: Sequence[float]) -> Tuple[float, float]:
    """sum(a) - sum(b) and its standard error from the parts' paired differences."""
    d = [x - y for x, y in zip(a, b)]
    k = len(d)
    mean = sum(d) / k
    variance = sum((x - mean) ** 2 for x in d) / (k - 1) if k > 1 else 0.0
    return float(sum(d)), math.sqrt(variance * k)
