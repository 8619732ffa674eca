"""One block's work, as a public step: collect a task's moments, fold them into sums, solve, write.

The loop (``engine.loop``) owns the order: for each task it has the step ``collect`` that task's moments on the
task's streams, hands them to the block's hyperparameter choice (``engine.policy``), which ``fold``s them into
its sums and ``solve``s; then the step ``write``s the chosen solution. The step holds no hyperparameter of its own:
every fold and solve is given the values it runs with, so a choice can fold and solve the same moments under
several candidates.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..core.block_sums import TaskSums
from ..core.hparams import FeatCalHParams
from ..core.meters import DriftMeter
from ..core.moments import LinearInputMoments, LinearInputStats, NormInputMoments, NormInputStats, Reduce, check_finite
from ..core.solver import (anchor, ridge_factor, solve_bias, solve_layernorm_affine, solve_linear_weight,
                           solve_norm_scale)
from ..families import LINEAR, NORM_KINDS, ModelFamily, Site
from .capture import capture_inputs, group_shared_inputs
from .plan import BlockPlan
from .streams import Stream

#: (phase name) -> a context manager that times the phase (``loop.PhaseTimer``)
Timer = Callable[[str], ContextManager]


@dataclass
class TaskStreams:
    """One task's hidden states at the current block's input, batch by batch."""

    calibrated: Stream  # through the calibrated prefix
    expert: Stream  # through the task's expert
    upstream: Optional[Stream] = None  # through the upstream merged model, when the loop tracks it


@dataclass
class LinearGroup:
    """Linear sites fed the very same tensor with the same token weighting: they share one set of moments."""

    names: List[str]
    profile: Hashable


@dataclass
class TaskMoments:
    """One task's input moments at one block, reduced across ranks and checked for non-finite values."""

    task: str
    linear: Dict[int, LinearInputStats]  # per linear group (``BlockStep.groups``)
    norm: Dict[str, NormInputStats]  # per norm site
    nbytes: int  # the accumulators' bytes, for the report's statistics peak
    drift_before: DriftMeter  # the uncalibrated block's output against the expert's, on these batches


@dataclass
class BlockSolution:
    """A block's new parameters as (site name, attribute, value) in the order they were solved, and how many solves
    each solver method did."""

    updates: List[Tuple[str, str, Tensor]] = field(default_factory=list)
    methods: Dict[str, int] = field(default_factory=dict)



class BlockStep:
    """The work on one block of the calibrated model, given the block of the base model it is anchored to."""

    def __init__(
        self,
        family: ModelFamily,
        plan: BlockPlan,
        block: nn.Module,
        base_block: nn.Module,
        num_blocks: int,
        device: torch.device,
        accumulation_dtype: torch.dtype,
        timer: Timer,
        reduce: Optional[Reduce] = None,
    ):
        self.family = family
        self.plan = plan
        self.block = block
        self.base_block = base_block
        self.num_blocks = num_blocks
        self.device = device
        self.accumulation_dtype = accumulation_dtype
        self.timer = timer
        self.reduce = reduce
        self.groups: Optional[List[LinearGroup]] = None  # found on the first batch collected
        self.peak_bytes = 0  # one task's accumulators plus the sums they are folded into, at most

    # ---- collect ------------------------------------------------------------------------------

    def collect(self, task: str, expert_block: nn.Module, streams: TaskStreams, batches: Optional[range] = None,
                advance: bool = True) -> TaskMoments:
        """Stream the task's batches (``batches``: those indices only) through the still-uncalibrated block and the
        expert's block (which the caller has put on the device) and return the task's moments. With ``advance``
        the expert (and upstream) streams are moved past this block; without, they stay at its input, for a
        later collection on the same batches (auto_select chooses on part of them, then solves on all)."""
        family, plan = self.family, self.plan
        linear = plan.names(LINEAR)
        norms = plan.names(*NORM_KINDS)
        exp_sites = family.sites(expert_block)
        linear_moments: Dict[int, LinearInputMoments] = {}
        norm_moments: Dict[str, NormInputMoments] = {}
        before = DriftMeter()
        cal, exp, upstream = streams.calibrated, streams.expert, streams.upstream
        for b in range(len(cal)) if batches is None else batches:
            hidden, meta = cal.get(b)
            with self.timer("snapshot forward"), capture_inputs({n: plan.sites[n] for n in linear + norms}) as cap_cal:
                uncalibrated = family.run_block(self.block, hidden, meta)
            exp_hidden, exp_meta = exp.get(b)
            exp_out: Dict[str, Tensor] = {}
            with self.timer("expert forward"), capture_inputs({n: exp_sites[n] for n in linear}, exp_out) as cap_exp:
                exp_hidden = family.run_block(expert_block, exp_hidden, exp_meta)
            if advance:
                exp.put(b, exp_hidden)
            with self.timer("drift"):
                before.update(uncalibrated, exp_hidden, family.valid_token_mask(meta, uncalibrated))
            if upstream is not None and advance:
                # The block still holds its merged weights: this advances the upstream trajectory.
                up_hidden, up_meta = upstream.get(b)
                with self.timer("upstream forward"):
                    up_hidden = family.run_block(self.block, up_hidden, up_meta)
                upstream.put(b, up_hidden)
            with self.timer("moments"):
                if self.groups is None:
                    self.groups = self._group_linears(cap_cal, linear)
                self._accumulate(cap_cal, cap_exp, exp_out, hidden, meta, norms, linear_moments, norm_moments)
        with self.timer("moments"):
            return self._finalize(task, linear_moments, norm_moments, before)

    def _group_linears(self, captured, linear) -> List[LinearGroup]:
        groups = []
        for shared in group_shared_inputs(captured, linear):
            by_profile: Dict[Hashable, List[str]] = {}
            for name in shared:
                profile = self.family.weight_profile(self.plan.index, self.num_blocks, name)
                by_profile.setdefault(profile, []).append(name)
            groups.extend(LinearGroup(names, profile) for profile, names in by_profile.items())
        return groups

    def _accumulate(self, cap_cal, cap_exp, exp_out, hidden, meta, norms, linear_moments, norm_moments) -> None:
        """Add one batch's captured inputs to the task's moments."""
        family, sites, dtype = self.family, self.plan.sites, self.accumulation_dtype
        weights_cache: Dict[Hashable, Optional[Tensor]] = {}

        def weights(profile):
            if profile not in weights_cache:
                weights_cache[profile] = family.token_weights(profile, hidden, meta, dtype)
            return weights_cache[profile]

        for gi, group in enumerate(self.groups):
            first = group.names[0]
            if gi not in linear_moments:
                dim = cap_cal[first].shape[-1]
                out_dims = {n: sites[n].out_features for n in group.names}
                # E[x_exp x_cal^T] costs d^2 per token; the modules' own expert outputs give
                # W_i E[x_exp x_cal^T] for sum(m) * d: cheaper when the group narrows (e.g. fc2).
                projected = out_dims if sum(out_dims.values()) < dim else None
                linear_moments[gi] = LinearInputMoments(dim, dtype, self.device, out_dims=projected)
            moments = linear_moments[gi]
            if moments.projected:
                moments.update(cap_cal[first], None, weights(group.profile), {n: exp_out[n] for n in group.names})
            else:
                moments.update(cap_cal[first], cap_exp[first], weights(group.profile))
        for name in norms:
            site = sites[name]
            if name not in norm_moments:
                norm_moments[name] = NormInputMoments(site.dim, site.normalizer(), dtype, self.device)
            norm_moments[name].update(cap_cal[name], weights(family.weight_profile(self.plan.index, self.num_blocks, name)))

    def _finalize(self, task, linear_moments, norm_moments, before) -> TaskMoments:
        nbytes = sum(m.nbytes() for m in itertools.chain(linear_moments.values(), norm_moments.values()))
        self.peak_bytes = max(self.peak_bytes, nbytes)
        modules = self.plan.modules
        linear = {}
        for gi, moments in linear_moments.items():
            linear[gi] = stats = moments.finalize(self.reduce)
            what = f"the input moments of {', '.join(modules[n][0] for n in self.groups[gi].names)} (task {task})"
            for tensor in stats.tensors():
                check_finite(tensor, what)
        norm = {}
        for name, moments in norm_moments.items():
            norm[name] = stats = moments.finalize(self.reduce)
            check_finite(stats.second_moment, f"the normalised-input moments of {modules[name][0]} (task {task})")
        return TaskMoments(task, linear, norm, nbytes, before)

    # ---- fold, solve, write -------------------------------------------------------------------

    def fold(self, moments: TaskMoments, expert_sites: Dict[str, Site], sums: TaskSums, hp: FeatCalHParams) -> None:
        """Add one task's moments to ``sums`` (the block's solve sums, or held-out objective sums) under ``hp``."""
        self.peak_bytes = max(self.peak_bytes, moments.nbytes + sums.nbytes())
        for gi, stats in moments.linear.items():
            sums.add_linear(gi, self.groups[gi], stats, expert_sites, hp, hp.calibrate_bias)
        for name, stats in moments.norm.items():
            sums.add_norm(name, stats, expert_sites[name])
        sums.num_tasks += 1

    def solve(self, sums, hp: FeatCalHParams, consume: bool = False,
              visit: Optional[Callable[[str, Dict[str, Tensor]], None]] = None) -> BlockSolution:
        """The block's new parameters from ``sums`` (a ``BlockSums``) under ``hp``; nothing is written. The base
        block must be on the device. With ``consume`` (sums solved once), each group's sums are dropped as soon as
        its modules are solved and every value is kept in its parameter's dtype: at Llama-3.2-1B shape a block's
        float64 solutions and its sums would otherwise be most of the host-memory peak. With ``visit``, each site's
        values are handed to ``visit(name, {attribute: value})`` as soon as they are solved and not kept (the
        solution holds only the solver counts): a candidate scored site by site never holds a whole block; its
        values are not checked for non-finite ones (a candidate that overflows scores NaN)."""
        solution = BlockSolution()
        methods: Counter = Counter()
        for name, (values,) in self._site_solutions(sums, hp, (hp.rho,), methods, consume=consume, check=visit is None):
            if visit is not None:
                visit(name, values)
            else:
                solution.updates.extend((name, attr, value) for attr, value in values.items())
        solution.methods = dict(methods)
        return solution

    def solve_over_rho(self, sums, hp: FeatCalHParams, rhos: Sequence[float],
                       visit: Callable[[float, str, Dict[str, Tensor]], None]) -> int:
        """Every site's values under ``hp`` at each rho of ``rhos``, handed to ``visit(rho, name, values)`` site by
        site, from two solves per site (one factorisation: rho is not in the system): each solution is affine in rho
        (the anchor rho W_mer + (1 - rho) W_base is the only place rho enters Eq. 17, 55 and 58, and each of them is
        linear in the anchor), so values(rho) = values(0) + rho (values(1) - values(0)), equal up to float rounding
        to solving at rho. The number of solves it made."""
        methods: Counter = Counter()
        for name, (zero, one) in self._site_solutions(sums, hp, (0.0, 1.0), methods, check=False):
            for rho in rhos:
                visit(rho, name, {attr: torch.lerp(zero[attr], one[attr], rho) for attr in zero})
        return sum(methods.values())

    def _site_solutions(self, sums, hp: FeatCalHParams, rhos: Sequence[float], methods: Counter,
                        consume: bool = False, check: bool = True):
        """(site name, [{attribute: value} at each of ``rhos``]) for every site in turn, solved from ``sums`` under
        ``hp`` with its rho replaced by each of ``rhos``. The linears of one input group share one factorisation of
        their ridge system, which no rho enters."""
        plan = self.plan
        cal_sites = plan.sites
        base_sites = self.family.sites(self.base_block)

        def anchored(name, attr, rho):
            return anchor(getattr(cal_sites[name], attr), getattr(base_sites[name], attr).to(self.device), rho)

        def kept(name, attr, value, what):
            if check:
                check_finite(value, f"the solved {what} of {plan.modules[name][0]}")
            if consume:  # the values write would copy in anyway
                value = value.to(getattr(cal_sites[name], attr).dtype)
            return value

        for gi, group in enumerate(self.groups or []):
            factor = ridge_factor(sums.gram[gi], hp.lambda_, hp.eps)
            for name in group.names:
                site = cal_sites[name]
                per_rho = []
                for rho in rhos:
                    result = solve_linear_weight(sums.gram[gi], sums.target[name], anchored(name, "weight", rho),
                                                 hp.lambda_, hp.eps, factor=factor)
                    methods[result.method] += 1
                    values = {"weight": kept(name, "weight", result.solution, "weight")}
                    if hp.calibrate_bias and site.bias is not None and name in sums.bias_target:
                        bias = solve_bias(
                            sums.omega[gi],
                            sums.bias_target[name],
                            sums.mean_cal[gi],
                            result.solution,
                            anchored(name, "bias", rho),
                            hp.lambda_,
                        )
                        values["bias"] = kept(name, "bias", bias, "bias")
                    per_rho.append(values)
                yield name, per_rho
            del factor
            if consume:
                sums.drop_group(gi, group.names)
        for name, entry in sums.norm.items():
            per_rho = []
            for rho in rhos:
                gamma_anchor = anchored(name, "weight", rho)
                values = {}
                if "r_beta" in entry:
                    gamma, beta = solve_layernorm_affine(
                        entry["q"], entry["z"], entry["r_gamma"], entry["r_beta"], sums.num_tasks,
                        gamma_anchor, anchored(name, "bias", rho), hp.lambda_, hp.eps,
                    )
                    values["bias"] = kept(name, "bias", beta, "shift")
                else:
                    gamma = solve_norm_scale(entry["q"], entry["r_gamma"], sums.num_tasks, gamma_anchor, hp.lambda_,
                                             hp.eps)
                values["weight"] = kept(name, "weight", gamma, "scale")
                per_rho.append(values)
            yield name, per_rho

    def write(self, solution: BlockSolution) -> None:
        # Load everything together: no site of this block saw a partially updated block.
        for name, attr, value in solution.updates:
            self.plan.sites[name].write(**{attr: value})
