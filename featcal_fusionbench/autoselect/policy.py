"""The per-block label-free choice (criterion ``objective``) as the loop's hyperparameter policy: cross-fitting.

Each task's calibration examples are in K parts (folds). At each block every part's moments are collected once and
folded into that part's solve sums and held-out objective sums (``core.objective.HeldoutObjective``). A candidate
(lambda, rho, alpha) is solved K times, each time on all parts but one (their sums averaged) and scored on the part
left out; its score is the sum over the K parts, and the K per-part scores give the noise of a difference between
two candidates (paired over the parts). The search (``Search``): lambda first, on the grid at the method's rho and
alpha, the grid widened past an edge that wins (down to the numerical floor, up to ``LAMBDA_CAP``); then rho (x alpha
when a grid of alphas is given) at that lambda, every rho from two solves per site (each solution is affine in rho).
rho is not widened: the held-out objective scores against the experts' own features, and a larger rho (the anchor
extrapolated past the merge, away from the base) moves toward them whatever the test labels say. Least shrinkage: the lambda
taken is the smallest whose held-out score is within ``noise_z`` standard errors of the best lambda's (at the same
rho and alpha), the mirror of the one-standard-error rule. The held-out objective is a squared error, dominated by
the directions in which the features vary most, which the ridge shrinks least; its cost falls on the directions of
small variance, which carry much of what tells one task's inputs apart: where the two differed on the offline
worlds measured, the test labels' best lambda lay below the held-out objective's (docs/featcal.md). The choice: the best score,
unless the method's own values (or the best lambda at the method's rho and alpha) score within ``noise_z`` standard
errors of it, which are then kept: the held-out evidence has to beat the configuration by more than its own noise. The loop
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


@dataclass(frozen=True)
class Search:
    """What a block's choice tries: ``lambdas`` (at the method's rho and alpha) then ``rhos`` x ``alphas`` at the
    chosen lambda (``coordinate``), or every combination at once (``grid``); ``floor``: the smallest lambda worth
    solving (below it the ridge is under the moments' own rounding); ``widen``: extend lambda past a winning
    edge; ``noise_z``: how many standard errors the evidence must beat the method's values by; ``least_shrinkage``:
    the smallest lambda within ``noise_z`` standard errors of the best one."""

    lambdas: Tuple[float, ...]
    rhos: Tuple[float, ...]
    alphas: Tuple[float, ...]
    mode: str = "coordinate"
    floor: float = 1e-8
    widen: bool = True
    noise_z: float = 2.0
    least_shrinkage: bool = True


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
        """Every new candidate's score on each part (solved on the others), into ``per_part``. Candidates that
        differ in rho alone share two solves per site (``BlockStep.solve_over_rho``)."""
        todo = list({candidate_key(c): c for c in candidates if candidate_key(c) not in per_part}.values())
        if not todo:
            return
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        scores = {candidate_key(c): [] for c in todo}
        groups: Dict[Tuple[float, float], List[Candidate]] = {}
        for c in todo:
            groups.setdefault((c["alpha"], c["lambda_"]), []).append(c)
        for k in range(self.policy.folds):
            held = self.heldout[k]
            for alpha in sorted({alpha for alpha, _ in groups}):
                # the parts but one, for one alpha at a time: a single set of fit sums beside the parts
                fit = average_of([p for j, p in enumerate(self.parts[alpha]) if j != k])
                for (group_alpha, lam), members in groups.items():
                    if group_alpha == alpha:
                        self._score_fold(step, fit, held, members, current, scores)
                del fit
        per_part.update(scores)

    def _score_fold(self, step, fit, held, candidates, current, scores) -> None:
        """One part's scores of candidates that share alpha and lambda."""
        hp = with_candidate(self.hparams, candidates[0])
        if len(candidates) == 1:
            terms: List[float] = []
            step.solve(fit, hp, visit=lambda name, params: terms.append(held.site(name, {**current[name], **params})))
            self.policy.solves += 1
            scores[candidate_key(candidates[0])].append(_finite_sum(terms))
            return
        by_rho: Dict[float, List[float]] = {c["rho"]: [] for c in candidates}
        self.policy.solves += 2
        step.solve_over_rho(fit, hp, list(by_rho), lambda rho, name, params: by_rho[rho].append(
            held.site(name, {**current[name], **params})))
        for c in candidates:
            scores[candidate_key(c)].append(_finite_sum(by_rho[c["rho"]]))

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
            best = _best(stage, total)
            best = self._widen_lambda(step, per_part, best, search.lambdas, widened)
            best, relaxed = self._least_shrinkage(per_part, best, search.lambdas, widened)
        else:
            stage = [{**reference, "lambda_": lam} for lam in search.lambdas]
            self._score(step, [reference, *stage], per_part)
            best = _best(stage, total)
            best = self._widen_lambda(step, per_part, best, search.lambdas, widened)
            best, relaxed = self._least_shrinkage(per_part, best, search.lambdas, widened)
            stage = [{**best, "rho": rho, "alpha": alpha} for rho in search.rhos for alpha in search.alphas]
            self._score(step, stage, per_part)
            best = _best([best, *stage], total)
        totals = {k: _total(v) for k, v in per_part.items()}
        chosen, kept = self._keep_within_noise(per_part, totals, best, reference)
        self.report = {"selection": self._summary(per_part, totals, chosen, kept, widened, search, step)}
        if relaxed is not None and not kept:
            self.report["selection"]["held_out_best_lambda"] = relaxed
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

    def _least_shrinkage(self, per_part, best: Candidate, grid: Sequence[float], widened) -> Tuple[Candidate, Optional[float]]:
        """The smallest scored lambda at ``best``'s rho and alpha whose held-out score is within ``noise_z`` standard
        errors of ``best``'s, and the best's lambda where that is another (else None)."""
        search = self.policy.search
        if not search.least_shrinkage:
            return best, None
        for lam in sorted({*grid, *widened.get("lambda_", [])}):
            if lam >= best["lambda_"]:
                break
            key = candidate_key({**best, "lambda_": lam})
            if key in per_part:
                margin, error = _difference(per_part[key], per_part[candidate_key(best)])
                if math.isfinite(margin) and margin <= search.noise_z * error:
                    return {**best, "lambda_": lam}, best["lambda_"]
        return best, None

    def _keep_within_noise(self, per_part, totals: Dict[str, float], best: Candidate,
                           reference: Candidate) -> Tuple[Candidate, Optional[str]]:
        """The method's own values where the held-out best (of every candidate scored) does not beat them by more
        than ``noise_z`` standard errors; else the best lambda at the method's rho and alpha where ``best`` does not
        beat it so; else ``best``. The method's values are weighed against the evidence itself, not against
        ``best``, which the least-shrinkage step may have moved off it within the noise: measured against that,
        values the evidence rejects by many standard errors were kept (docs/featcal.md, "Do no harm")."""
        z = self.policy.search.noise_z
        finite = [k for k, v in totals.items() if math.isfinite(v)]
        top = min(finite, key=totals.get) if finite else candidate_key(best)
        rivals = (("method", reference, top),
                  ("method's rho and alpha", {**reference, "lambda_": best["lambda_"]}, candidate_key(best)))
        for kept, candidate, against in rivals:
            key = candidate_key(candidate)
            if key == candidate_key(best):
                return best, None
            if key in per_part:
                margin, error = _difference(per_part[key], per_part[against])
                if math.isfinite(margin) and margin <= z * error:
                    return candidate, kept
        return best, None

    def _summary(self, per_part, totals: Dict[str, float], chosen, kept, widened, search: Search,
                 step) -> Dict[str, Any]:
        key = candidate_key(chosen)
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


def _finite_sum(terms: Sequence[float]) -> float:
    """A candidate's score on one part; NaN where a site's solution overflowed (never chosen)."""
    total = float(sum(terms))
    return total if math.isfinite(total) else math.nan


def _best(candidates: Sequence[Candidate], total) -> Candidate:
    """The lowest total among the candidates whose total is finite; the first listed on a tie (the grid's
    order: a seeded run repeats its choice)."""
    finite = [c for c in candidates if math.isfinite(total(c))]
    if not finite:
        raise ValueError("every candidate's held-out score is non-finite; no choice is possible")
    return min(finite, key=total)


def _difference(a: Sequence[float], b: Sequence[float]) -> Tuple[float, float]:
    """sum(a) - sum(b) and its standard error from the parts' paired differences."""
    d = [x - y for x, y in zip(a, b)]
    k = len(d)
    mean = sum(d) / k
    variance = sum((x - mean) ** 2 for x in d) / (k - 1) if k > 1 else 0.0
    return float(sum(d)), math.sqrt(variance * k)
