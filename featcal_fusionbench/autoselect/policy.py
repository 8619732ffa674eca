"""The per-block label-free choice (criterion ``objective``) as the loop's hyperparameter policy.

At each block the fit moments of every task are folded once per distinct alpha (only the targets depend on it) and
the held-out moments into the block's objective (``core.objective.HeldoutObjective``); every candidate
(lambda, rho, alpha) is then a closed-form solve on the fit sums, scored on the held-out sums. The loop solves the
block with the best on all of each task's batches (fit and held-out) and loads it, so the next block chooses on
the chosen prefix (greedy, per block), in the one pass that calibrates.
"""

from __future__ import annotations

from typing import Any, Dict, List

from ..core.block_sums import BlockSums
from ..core.hparams import FeatCalHParams
from ..core.moments import NonFiniteError
from ..core.objective import HeldoutObjective
from ..engine.step import BlockStep, TaskMoments
from .options import Candidate, best_of, candidate_key, with_candidate


class HeldoutSelection:
    """An ``engine.policy.HParamPolicy`` that chooses each block's values among ``candidates`` on held-out moments;
    ``solves`` counts the candidate solves over the whole run."""

    needs_heldout = True

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
        if part == "fit":
            for alpha in self.policy.alphas:
                step.fold(moments, expert_sites, self.fit_sums[alpha], with_candidate(self.hparams, {"alpha": alpha}))
        elif part == "heldout":
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
