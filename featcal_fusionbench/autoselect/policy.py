"""The per-block label-free choice (criterion ``objective``) as the loop's hyperparameter policy.

At each block the fit moments of every task are folded once per distinct alpha (only the targets depend on it) and
the held-out moments into the block's objective (``core.objective.HeldoutObjective``); every candidate
(lambda, rho, alpha) is then a closed-form solve on the fit sums, scored on the held-out sums, and the best is
loaded, so the next block chooses on the chosen prefix (greedy, per block).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..core.block_sums import BlockSums
from ..core.hparams import FeatCalHParams
from ..core.moments import NonFiniteError
from ..core.objective import HeldoutObjective
from ..engine.step import BlockSolution, BlockStep, TaskMoments
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
    """One block's choice; its ``report`` records every candidate's score and the chosen one."""

    def __init__(self, policy: HeldoutSelection, hparams: FeatCalHParams):
        self.policy = policy
        self.hparams = hparams
        self.fit_sums = {alpha: BlockSums() for alpha in policy.alphas}
        self.heldout = HeldoutObjective()
        self.report: Dict[str, Any] = {}

    def add_task(self, step: BlockStep, fit: TaskMoments, heldout: Optional[TaskMoments], expert_sites) -> None:
        for alpha in self.policy.alphas:
            step.fold(fit, expert_sites, self.fit_sums[alpha], with_candidate(self.hparams, {"alpha": alpha}))
        step.fold(heldout, expert_sites, self.heldout, self.hparams)

    def solve(self, step: BlockStep) -> BlockSolution:
        current = {n: {"weight": s.weight, "bias": s.bias} for n, s in step.plan.sites.items()}
        scores: Dict[str, float] = {}
        best = None  # (score, key, solution): only the best candidate's parameters are kept
        for candidate in self.policy.candidates:
            key = candidate_key(candidate)
            try:
                solution = step.solve(self.fit_sums[candidate["alpha"]], with_candidate(self.hparams, candidate))
            except NonFiniteError:
                scores[key] = float("nan")  # a candidate whose solve overflows is never chosen
                continue
            self.policy.solves += 1
            scores[key] = self.heldout.score(solution.by_site(), current)
            if best is None or scores[key] < best[0]:  # strict: ties keep the earlier candidate
                best = (scores[key], key, solution)
        chosen = best_of(scores, higher_is_better=False)
        assert best is not None and chosen == best[1]
        self.fit_sums = self.heldout = None
        self.report = {"selection": {"chosen": chosen, "scores": scores}}
        return best[2]
