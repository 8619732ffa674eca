"""Per-block selection rules tried for issue 61 beside the product's (``autoselect.policy.HeldoutSelection``), as
engine policies for the lab (``autoselect_lab``). Not the product: what is kept moves there."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from featcal_fusionbench.autoselect.options import Candidate, best_of, candidate_key, with_candidate
from featcal_fusionbench.core.block_sums import BlockSums
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.core.moments import NonFiniteError
from featcal_fusionbench.engine.step import BlockStep, TaskMoments
from featcal_fusionbench.core.objective import HeldoutObjective, _add_scaled
from featcal_fusionbench.core.moments import add_into
from featcal_fusionbench.core.solver import task_weight


# ---- the product's rule before issue 61 (one held-out quarter, every candidate at once), for comparison ----------

class HeldoutSelection:
    """An ``engine.policy.HParamPolicy`` that chooses each block's values among ``candidates`` on held-out moments;
    ``solves`` counts the candidate solves over the whole run."""

    needs_parts = True  # two parts: fit (0), held-out (1)

    def __init__(self, candidates: List[Candidate]):
        self.candidates = candidates
        self.alphas = sorted({c["alpha"] for c in candidates})
        self.solves = 0

    def check(self, num_blocks: int) -> None:
        pass  # any number of blocks

    def for_block(self, index: int, hparams: FeatCalHParams) -> "HeldoutChoice":
        return HeldoutChoice(self, hparams)


class HeldoutChoice:
    """One block's choice (an ``engine.policy.BlockSelection``); its ``report`` records every candidate's score and
    the chosen one."""

    def __init__(self, policy: HeldoutSelection, hparams: FeatCalHParams):
        self.policy = policy
        self.hparams = hparams
        self.fit_sums = {alpha: BlockSums() for alpha in policy.alphas}
        self.heldout = HeldoutObjective()
        self.report: Dict[str, Any] = {}

    def add(self, part: str, step: BlockStep, moments: TaskMoments, expert_sites) -> None:
        if part in ("fit", 0):
            for alpha in self.policy.alphas:
                step.fold(moments, expert_sites, self.fit_sums[alpha], with_candidate(self.hparams, {"alpha": alpha}))
        elif part in ("heldout", 1):
            step.fold(moments, expert_sites, self.heldout, self.hparams)
        else:
            raise ValueError(f"a task's part is 'fit' or 'heldout', not {part!r}")
        held = moments.nbytes + self.heldout.nbytes() + sum(sums.nbytes() for sums in self.fit_sums.values())
        step.peak_bytes = max(step.peak_bytes, held)  # every sum the choice keeps, beside one task part's moments

    def choose(self, step: BlockStep) -> FeatCalHParams:
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        scores: Dict[str, float] = {}
        for candidate in self.policy.candidates:
            key = candidate_key(candidate)
            terms: List[float] = []

            def score(name, params):  # each site scored as soon as it is solved: no candidate's block is held whole
                terms.append(self.heldout.site(name, {**current[name], **params}))

            try:
                step.solve(self.fit_sums[candidate["alpha"]], with_candidate(self.hparams, candidate), visit=score)
            except NonFiniteError:
                scores[key] = float("nan")  # a candidate whose solve overflows is never chosen
                continue
            self.policy.solves += 1
            scores[key] = sum(terms)
        chosen = best_of(scores, higher_is_better=False)  # ties keep the earlier candidate
        self.fit_sums = self.heldout = None
        self.report = {"selection": {"chosen": chosen, "scores": scores}}
        by_key = {candidate_key(c): c for c in self.policy.candidates}
        return with_candidate(self.hparams, by_key[chosen])


class OwnTargetObjective(HeldoutObjective):
    """The held-out objective against the solve's own target (the hparams' alpha), not the expert's features: the
    held-out error of the very regression each candidate solves."""

    def add_linear(self, gi, group, stats, expert_sites, hparams, with_bias=True) -> None:
        d = torch.float64
        omega = task_weight(stats.gram, hparams.eps)
        mean_cal = stats.mean_cal.to(d)
        _add_scaled(self.gram, gi, stats.gram, omega)
        add_into(self.mean_cal, gi, omega * mean_cal)
        self.omega[gi] = self.omega.get(gi, 0.0) + omega
        for name in group.names:
            site = expert_sites[name]
            sd = stats.gram.dtype
            weight = site.weight.to(sd)
            bias = None if site.bias is None else site.bias.to(sd)
            cross = stats.target(name, weight, bias, hparams.alpha).to(d)
            if bias is not None:
                cross = cross + torch.outer(bias.to(d), mean_cal)
                mean_out = stats.bias_target(name, weight, bias, hparams.alpha).to(d)
            else:
                mean_out = (hparams.alpha * stats.expert_mean(name, weight, None)
                            + (1 - hparams.alpha) * (weight @ stats.mean_cal)).to(d)
            self.group_of[name] = gi
            _add_scaled(self.cross, name, cross, omega)
            add_into(self.mean_out, name, omega * mean_out)


class VariantSelection(HeldoutSelection):
    """``target``: "expert" (the product's) or "own"; ``prefer``: the candidate kept unless another scores lower by
    more than ``tolerance`` x |its score| (None: the grid's first, as the product)."""

    def __init__(self, candidates: List[Candidate], target: str = "own", prefer: Candidate = None,
                 tolerance: float = 0.0):
        super().__init__(candidates)
        self.target = target
        self.prefer = None if prefer is None else candidate_key(prefer)
        self.tolerance = tolerance
        self.log: List[Dict[str, Any]] = []

    def for_block(self, index, hparams):
        return VariantChoice(self, hparams, index)


class VariantChoice(HeldoutChoice):
    def __init__(self, policy: VariantSelection, hparams, index):
        super().__init__(policy, hparams)
        self.index = index
        if policy.target == "own":
            self.heldout = OwnTargetObjective()

    def choose(self, step):
        """The product's choice (``HeldoutChoice.choose``), every site's score per candidate kept for the log."""
        from featcal_fusionbench.autoselect.options import best_of
        from featcal_fusionbench.core.moments import NonFiniteError

        policy = self.policy
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        scores: Dict[str, float] = {}
        sites: Dict[str, Dict[str, float]] = {}
        for candidate in policy.candidates:
            key = candidate_key(candidate)
            terms: Dict[str, float] = {}

            def score(name, params):
                terms[name] = self.heldout.site(name, {**current[name], **params})

            try:
                step.solve(self.fit_sums[candidate["alpha"]], with_candidate(self.hparams, candidate), visit=score)
            except NonFiniteError:
                scores[key] = float("nan")
                continue
            policy.solves += 1
            scores[key] = sum(terms.values())
            sites[key] = terms
        chosen = best_of(scores, higher_is_better=False)
        if policy.prefer is not None and policy.prefer in scores:
            keep = scores[policy.prefer]
            if not scores[chosen] < keep - policy.tolerance * abs(keep):
                chosen = policy.prefer
        self.fit_sums = self.heldout = None
        self.report = {"selection": {"chosen": chosen, "scores": scores}}
        policy.log.append({"block": self.index, "scores": scores, "sites": sites, "chosen": chosen})
        by_key = {candidate_key(c): c for c in policy.candidates}
        return with_candidate(self.hparams, by_key[chosen])


# ---- cross-fitting: K folds of each task's examples, each held out once --------------------------------------


def combine(parts, weights):
    """sum_j weights[j] * parts[j] of ``BlockSums`` (every entry is linear in the tasks' moments)."""
    from collections import Counter

    from featcal_fusionbench.core.block_sums import BlockSums

    out = BlockSums()
    out.omega = Counter()
    out.num_tasks = 0
    for sums, w in zip(parts, weights):
        for store in ("gram", "mean_cal", "target", "bias_target"):
            mine = getattr(out, store)
            for key, value in getattr(sums, store).items():
                mine[key] = mine[key] + w * value if key in mine else w * value.clone()
        for key, value in sums.omega.items():
            out.omega[key] += w * value
        for name, entry in sums.norm.items():
            mine = out.norm.setdefault(name, {})
            for key, value in entry.items():
                mine[key] = mine[key] + w * value if key in mine else w * value.clone()
        out.num_tasks += w * sums.num_tasks
    return out


class CrossFitSelection(VariantSelection):
    """Each task's calibration examples in ``folds`` parts; every candidate solved on all parts but one and scored
    on that one, for each part in turn; a candidate's score is the sum over parts, and ``prefer`` is kept unless a
    candidate beats it by more than ``z`` standard errors of the per-part differences."""

    def __init__(self, candidates, folds: int = 4, z: float = 0.0, **kwargs):
        super().__init__(candidates, **kwargs)
        self.folds = folds
        self.z = z

    def for_block(self, index, hparams):
        return CrossFitChoice(self, hparams, index)


class CrossFitChoice:
    def __init__(self, policy: CrossFitSelection, hparams, index):
        from featcal_fusionbench.core.block_sums import BlockSums

        self.policy, self.hparams, self.index = policy, hparams, index
        self.parts = [BlockSums() for _ in range(policy.folds)]
        self.heldout = [OwnTargetObjective() if policy.target == "own" else HeldoutObjective()
                        for _ in range(policy.folds)]
        self.report: Dict[str, Any] = {}

    def add(self, part: int, step, moments, expert_sites) -> None:
        step.fold(moments, expert_sites, self.parts[part], self.hparams)
        step.fold(moments, expert_sites, self.heldout[part], self.hparams)

    def choose(self, step):
        import math
        import statistics

        from featcal_fusionbench.core.moments import NonFiniteError

        policy, k = self.policy, self.policy.folds
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        per_fold: Dict[str, List[float]] = {}
        fits = [combine([p for j, p in enumerate(self.parts) if j != f], [1.0 / (k - 1)] * (k - 1)) for f in range(k)]
        for candidate in policy.candidates:
            key = candidate_key(candidate)
            values = []
            try:
                for f in range(k):
                    terms = []
                    step.solve(fits[f], with_candidate(self.hparams, candidate),
                               visit=lambda name, params: terms.append(
                                   self.heldout[f].site(name, {**current[name], **params})))
                    values.append(sum(terms))
            except NonFiniteError:
                values = [math.nan] * k
            per_fold[key] = values
        scores = {key: sum(v) for key, v in per_fold.items()}
        finite = {key: v for key, v in scores.items() if not math.isnan(v)}
        chosen = min(finite, key=lambda key: (finite[key], list(scores).index(key)))
        if policy.prefer is not None and policy.prefer in finite:
            d = [a - b for a, b in zip(per_fold[chosen], per_fold[policy.prefer])]
            se = statistics.stdev(d) * math.sqrt(k) if k > 1 else 0.0  # of the sum over folds
            if not sum(d) < -policy.z * se:
                chosen = policy.prefer
        self.parts = self.heldout = None
        self.report = {"selection": {"chosen": chosen, "scores": scores}}
        policy.log.append({"block": self.index, "scores": scores, "per_fold": per_fold, "chosen": chosen})
        by_key = {candidate_key(c): c for c in policy.candidates}
        return with_candidate(self.hparams, by_key[chosen])


# ---- per-site choice: each calibrated module (and norm) its own lambda / rho ------------------------------------


class PerSiteSelection(CrossFitSelection):
    """Cross-fitted as ``CrossFitSelection``, but every site takes the candidate that minimises its own held-out
    term (the block's objective is a sum over sites, each solved independently of the others given the sums)."""

    def for_block(self, index, hparams):
        return PerSiteChoice(self, hparams, index)


class PerSiteChoice(CrossFitChoice):
    def choose(self, step):
        import math

        policy, k = self.policy, self.policy.folds
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        fits = [combine([p for j, p in enumerate(self.parts) if j != f], [1.0 / (k - 1)] * (k - 1)) for f in range(k)]
        site_scores: Dict[str, Dict[str, float]] = {}
        for candidate in policy.candidates:
            key = candidate_key(candidate)
            totals: Dict[str, float] = {}
            for f in range(k):
                def visit(name, params, f=f):
                    totals[name] = totals.get(name, 0.0) + self.heldout[f].site(name, {**current[name], **params})
                try:
                    step.solve(fits[f], with_candidate(self.hparams, candidate), visit=visit)
                except NonFiniteError:
                    totals = {n: math.nan for n in totals}
            site_scores[key] = totals
        names = list(next(iter(site_scores.values())))
        by_key = {candidate_key(c): c for c in policy.candidates}
        chosen = {}
        for name in names:
            finite = {key: v[name] for key, v in site_scores.items() if not math.isnan(v[name])}
            chosen[name] = min(finite, key=finite.get)
        self.parts = self.heldout = None
        self.report = {"selection": {"chosen_per_site": chosen}}
        policy.log.append({"block": self.index, "sites": site_scores, "chosen": chosen})
        return {name: with_candidate(self.hparams, by_key[key]) for name, key in chosen.items()}


class PerSiteFixed:
    """A block choice solving each site with its own hyperparameters (``engine.policy.BlockChoice``)."""

    def __init__(self, per_site, report):
        self.per_site = per_site
        self.report = report
        self.sums = BlockSums()
        self.fold_hp = next(iter(per_site.values()))  # alpha is the same for all

    def add_task(self, step, moments, expert_sites):
        step.fold(moments, expert_sites, self.sums, self.fold_hp)

    def solve(self, step):
        from featcal_fusionbench.engine.step import BlockSolution

        solution = BlockSolution()
        groups: Dict[str, List[str]] = {}
        for name, hp in self.per_site.items():
            groups.setdefault(candidate_key({"lambda_": hp.lambda_, "rho": hp.rho, "alpha": hp.alpha}), []).append(name)
        for key, names in groups.items():
            hp = self.per_site[names[0]]
            values: Dict[str, Dict[str, Any]] = {}
            step.solve(self.sums, hp, visit=lambda name, params: values.__setitem__(name, params))
            for name in names:
                for attr, value in values[name].items():
                    solution.updates.append((name, attr, value.to(getattr(step.plan.sites[name], attr).dtype)))
        return solution


def per_site_engine(engine_cls):
    class PerSiteEngine(engine_cls):
        def _choose(self, step, base_block, expert_blocks, streams):
            from featcal_fusionbench.models.residency import on_device

            selection = self.policy.for_block(step.plan.index, self.hparams)
            for task, expert_block in expert_blocks.items():
                with on_device([expert_block], self.device):
                    sites = self.family.sites(expert_block)
                    for part, batches in enumerate(self.parts[task]):
                        moments = step.collect(task, expert_block, streams[task], batches, advance=False)
                        selection.add(part, step, moments, sites)
                        del moments
            with on_device([base_block], self.device):
                per_site = selection.choose(step)
            return PerSiteFixed(per_site, selection.report)

    return PerSiteEngine


# ---- per task: each task's held-out objective apart -----------------------------------------------------------


class TaskCrossFitSelection(CrossFitSelection):
    """Cross-fitted as ``CrossFitSelection``, every task's held-out objective kept apart. ``rule``: "sum" (the
    tasks' objectives summed, as the product does) or "normalized" (each task's regret to its own best, as a
    fraction of its own held-out gain over the uncalibrated block, averaged over tasks: every task one vote)."""

    def __init__(self, candidates, rule: str = "normalized", **kwargs):
        super().__init__(candidates, **kwargs)
        self.rule = rule

    def for_block(self, index, hparams):
        return TaskCrossFitChoice(self, hparams, index)


class TaskCrossFitChoice(CrossFitChoice):
    def __init__(self, policy, hparams, index):
        super().__init__(policy, hparams, index)
        self.task_heldout: Dict[str, List[HeldoutObjective]] = {}

    def add(self, part, step, moments, expert_sites):
        step.fold(moments, expert_sites, self.parts[part], self.hparams)
        held = self.task_heldout.setdefault(moments.task, [HeldoutObjective() for _ in range(self.policy.folds)])
        step.fold(moments, expert_sites, held[part], self.hparams)

    def choose(self, step):
        import math

        policy, k = self.policy, self.policy.folds
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        fits = [combine([p for j, p in enumerate(self.parts) if j != f], [1.0 / (k - 1)] * (k - 1)) for f in range(k)]
        per_task: Dict[str, Dict[str, float]] = {}
        for candidate in policy.candidates:
            key = candidate_key(candidate)
            totals = {t: 0.0 for t in self.task_heldout}
            for f in range(k):
                def visit(name, params, f=f):
                    for t, held in self.task_heldout.items():
                        totals[t] += held[f].site(name, {**current[name], **params})
                try:
                    step.solve(fits[f], with_candidate(self.hparams, candidate), visit=visit)
                except NonFiniteError:
                    totals = {t: math.nan for t in totals}
            per_task[key] = totals
        uncal = {t: sum(held[f].site(n, current[n]) for f in range(k) for n in current)
                 for t, held in self.task_heldout.items()}
        keys = list(per_task)
        if policy.rule == "sum":
            score = {key: sum(per_task[key].values()) for key in keys}
        else:
            score = {}
            for key in keys:
                regrets = []
                for t in self.task_heldout:
                    best = min(per_task[c][t] for c in keys)
                    regrets.append((per_task[key][t] - best) / max(uncal[t] - best, 1e-30))
                score[key] = sum(regrets) / len(regrets)
        chosen = min(score, key=score.get)
        self.parts = self.heldout = self.task_heldout = None
        self.report = {"selection": {"chosen": chosen, "scores": score}}
        policy.log.append({"block": self.index, "per_task": per_task, "uncalibrated": uncal, "chosen": chosen})
        by_key = {candidate_key(c): c for c in policy.candidates}
        return with_candidate(self.hparams, by_key[chosen])
