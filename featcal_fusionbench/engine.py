"""The forward-order calibration loop (paper Algorithm 1).

For each block, in forward order:
  1. snapshot: the still-uncalibrated block runs on the calibrated prefix's hidden
     states, and expert i's own block on expert i's hidden states for task i's
     samples; forward pre-hooks capture every calibrated module's input and the
     moments stream into per-task sums (one set per shared input, e.g. q/k/v);
  2. solve: each task's moments are folded into omega-weighted sums as soon as
     the task is done (memory does not grow with the number of tasks), then
     weights (Eq. 17), biases (Eq. 55) and norm affines (Eq. 59) are solved;
  3. load all of the block's new parameters together, and only then advance the
     calibrated hidden states through the calibrated block.
Experts and the base model stay where they are (host memory); only the block in
use visits the device. Every task's hidden-state streams live in a ``StreamStore``
(``streams``): on the device within a byte budget, spilled to host or disk beyond it. Everything model-specific comes from the model family
(``families``): the walk, the calibrated sites and their parameters, token weights.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .capture import capture_inputs, group_shared_inputs
from .drift import DriftMeter
from .hparams import FeatCalHParams
from .lazy_models import is_lazy, materialize, release
from .families import LINEAR, NORM_KINDS, ModelFamily, Site
from .moments import LinearInputMoments, NormInputMoments, Reduce, add_into, check_finite
from .streams import Stream, StreamOptions, StreamStore
from .solver import (
    anchor,
    solve_bias,
    solve_layernorm_affine,
    solve_linear_weight,
    solve_norm_scale,
    task_weight,
)

if TYPE_CHECKING:
    from .autoselect import BlockSelector

log = logging.getLogger(__name__)

LogFn = Callable[[Dict[str, float], int], None]


@contextmanager
def on_device(modules: Iterable[nn.Module], device: torch.device):
    """Move modules to ``device`` for the duration of the block, then put them back; a lazy module (a base or
    expert read from its checkpoint, ``lazy_models``) is read onto the device and released after."""
    # Once each: a module listed twice (T5's shared embedding) would otherwise record the device as its origin.
    modules = list({id(m): m for m in modules}.values())
    origins, read = [], []
    try:
        for module in modules:
            if is_lazy(module):
                read.append(module)
                materialize(module, device)
                origins.append(None)
                continue
            first = next(itertools.chain(module.parameters(), module.buffers()), None)
            origins.append(None if first is None else first.device)
            module.to(device)
        yield
    finally:
        for module in read:
            release(module)
        for module, origin in zip(modules, origins):
            if origin is not None:
                module.to(origin)


class PhaseTimer:
    """Seconds per phase of the loop, for profiling; a no-op unless enabled (CUDA is synchronised then)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.sync = enabled and device.type == "cuda"
        self.seconds: Dict[str, float] = Counter()

    @contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - started


@dataclass
class BlockPlan:
    """Which sites of one block are calibrated: relative name -> (full name, kind), and the sites themselves
    (of the model the plan was made for)."""

    index: int
    modules: Dict[str, tuple]
    sites: Dict[str, Site] = field(default_factory=dict)

    def names(self, *kinds: str) -> List[str]:
        return [rel for rel, (_, kind) in self.modules.items() if kind in kinds]


def plan_blocks(family: ModelFamily, model: nn.Module, hparams: FeatCalHParams) -> List[BlockPlan]:
    """Select the sites to calibrate in every block; raise if none is selected."""
    full_names = {id(m): n for n, m in model.named_modules()}
    pattern = re.compile(hparams.module_regex) if hparams.module_regex is not None else None
    plans = []
    for index, block in enumerate(family.blocks(model)):
        selected, sites = {}, {}
        for rel, site in family.sites(block).items():
            if site.kind in NORM_KINDS and (not hparams.calibrate_layernorm or site.weight is None):
                continue
            full = f"{full_names[id(block)]}.{rel}"
            if pattern is not None and not pattern.search(full):
                continue
            selected[rel] = (full, site.kind)
            sites[rel] = site
        plans.append(BlockPlan(index, selected, sites))
    if not any(plan.modules for plan in plans):
        raise ValueError(
            f"no module selected for calibration (module_regex={hparams.module_regex!r}, "
            f"calibrate_layernorm={hparams.calibrate_layernorm}); example module names: "
            + ", ".join(list(full_names.values())[1:6])
        )
    return plans


def block_reserve_bytes(blocks: Iterable[nn.Module], accumulation_dtype: torch.dtype) -> int:
    """Device memory one block's work needs beside the calibrated model, which the automatic stream budget leaves
    free: the base's and an expert's copy of the largest block, and the statistics of its linear maps. For a weight of
    m x d, that is a task's Gram and cross moments and the block's summed Gram (d x d each; counted per module though
    q/k/v share theirs, so an overestimate) and two m x d targets."""
    itemsize = torch.empty((), dtype=accumulation_dtype).element_size()

    def need(block: nn.Module) -> int:
        params = list(block.parameters())
        weights = 2 * sum(p.numel() * p.element_size() for p in params)
        statistics = sum(4 * p.shape[1] ** 2 + 2 * p.numel() for p in params if p.dim() == 2) * itemsize
        return weights + statistics

    return max(need(block) for block in blocks)


@dataclass
class _LinearGroup:
    names: List[str]
    profile: Hashable


class _BlockSums:
    """omega-weighted sums over tasks for one block (the right-hand sides of Eq. 16, 54, 58)."""

    def __init__(self):
        self.gram: Dict[int, Tensor] = {}
        self.omega: Dict[int, float] = Counter()
        self.mean_cal: Dict[int, Tensor] = {}
        self.target: Dict[str, Tensor] = {}
        self.bias_target: Dict[str, Tensor] = {}
        self.norm: Dict[str, Dict[str, Tensor]] = {}
        self.num_tasks = 0

    def nbytes(self) -> int:
        tensors = [*self.gram.values(), *self.mean_cal.values(), *self.target.values(), *self.bias_target.values()]
        tensors += [t for entry in self.norm.values() for t in entry.values() if isinstance(t, Tensor)]
        return sum(t.nbytes for t in tensors)

    def drop_group(self, gi: int, names: Sequence[str]) -> None:
        """Forget one linear group's sums (solved)."""
        for store, keys in ((self.gram, [gi]), (self.mean_cal, [gi]), (self.target, names), (self.bias_target, names)):
            for key in keys:
                store.pop(key, None)

    def add_linear(self, gi, group, stats, expert_sites, hparams, with_bias):
        omega = task_weight(stats.gram, hparams.eps)
        add_into(self.gram, gi, omega * stats.gram)
        self.omega[gi] += omega
        add_into(self.mean_cal, gi, omega * stats.mean_cal)
        dtype = stats.gram.dtype
        for name in group.names:
            expert = expert_sites[name]
            weight = expert.weight.to(dtype)
            bias = None if expert.bias is None else expert.bias.to(dtype)
            add_into(self.target, name, omega * stats.target(name, weight, bias, hparams.alpha))
            if with_bias and bias is not None:
                add_into(self.bias_target, name, omega * stats.bias_target(name, weight, bias, hparams.alpha))

    def add_norm(self, name, stats, expert_site):
        dtype = stats.mean.dtype
        gamma = expert_site.weight.to(dtype)
        beta = expert_site.bias.to(dtype) if expert_site.bias is not None else None
        entry = {  # the sums start as copies: add_into adds to them in place
            "q": stats.second_moment.clone(),
            "z": stats.mean.clone(),
            "r_gamma": stats.second_moment * gamma + (stats.mean * beta if beta is not None else 0.0),
        }
        if beta is not None:
            entry["r_beta"] = stats.mean * gamma + beta
        for key, value in entry.items():
            add_into(self.norm.setdefault(name, {}), key, value)


class FeatCalEngine:
    """Runs Algorithm 1 on one calibrated model; see the module docstring."""

    def __init__(
        self,
        family: ModelFamily,
        hparams: FeatCalHParams,
        device: torch.device,
        *,
        reduce: Optional[Reduce] = None,
        track_upstream: bool = False,
        log_fn: Optional[LogFn] = None,
        progress: bool = True,
        profile: bool = False,
        streams: Optional[StreamOptions] = None,
        schedule: Optional[Sequence[FeatCalHParams]] = None,
        selector: Optional["BlockSelector"] = None,
    ):
        """``schedule``: one set of hyperparameters per block (``auto_select``'s per-block choice) instead of
        ``hparams`` everywhere. ``selector``: choose each block's values on held-out moments (``run``'s
        ``heldout_batches``) and record the choice in the report (``autoselect``)."""
        self.family = family
        self.hparams = hparams
        self.schedule = None if schedule is None else list(schedule)
        self.selector = selector
        self.device = torch.device(device)
        self.reduce = reduce
        self.track_upstream = track_upstream
        self.log_fn = log_fn
        self.progress = progress
        self.timer = PhaseTimer(profile, self.device)
        self.stream_options = streams or StreamOptions()
        self.statistics_bytes = 0  # peak bytes of one task's moments plus a block's sums

    def hparams_at(self, index: int) -> FeatCalHParams:
        return self.hparams if self.schedule is None else self.schedule[index]

    # ---- streams ------------------------------------------------------------------------------

    def _embed(self, model, expert, batches, store: StreamStore, upstream: bool = True) -> tuple:
        """The task's calibrated and expert streams, and the upstream one when tracked (it starts as the calibrated)."""
        family = self.family
        cal, exp = store.stream(), store.stream()
        upstream = store.stream() if self.track_upstream and upstream else None
        with on_device(family.stem_modules(expert), self.device):
            for inputs in batches:
                with self.timer("embed"):
                    inputs = family.inputs_to(inputs, self.device)
                    embedded = [family.embed(source, inputs) for source in (model, expert)]
                for stream, (hidden, meta) in zip((cal, exp), embedded):
                    stream.append(hidden, meta)
                if upstream is not None:
                    upstream.append(*embedded[0])
        if not len(cal):
            raise ValueError("a task produced no calibration batches")
        return cal, exp, upstream

    def _enter_block(self, model, index, stream: Stream) -> None:
        if type(self.family).enter_block is ModelFamily.enter_block:
            return  # the identity: spare fetching every spilled batch (and a lazy model's stem) for nothing
        with on_device(self.family.stem_modules(model), self.device):
            for b in range(len(stream)):
                hidden, meta = stream.get(b)
                entered = self.family.enter_block(model, index, hidden, meta)
                if entered[0] is not hidden or entered[1] is not meta:
                    stream.put(b, *entered)

    def _advance(self, block, stream: Stream) -> None:
        """Run every batch of ``stream`` through ``block``."""
        for b in range(len(stream)):
            hidden, meta = stream.get(b)
            stream.put(b, self.family.run_block(block, hidden, meta))

    # ---- one block ----------------------------------------------------------------------------

    def _snapshot_task(self, plan, block, expert_block, exp_sites, streams, num_blocks, groups):
        """Stream task i's batches through the uncalibrated and the expert block; return moments."""
        family = self.family
        linear = plan.names(LINEAR)
        norms = plan.names(*NORM_KINDS)
        cal_sites = plan.sites
        watched = linear + norms
        linear_moments: Dict[int, LinearInputMoments] = {}
        norm_moments: Dict[str, NormInputMoments] = {}
        before = DriftMeter()
        cal, exp, upstream = streams
        for b in range(len(cal)):
            hidden, meta = cal.get(b)
            with self.timer("snapshot forward"), capture_inputs({n: cal_sites[n] for n in watched}) as cap_cal:
                uncalibrated = family.run_block(block, hidden, meta)
            exp_hidden, exp_meta = exp.get(b)
            exp_out: Dict[str, Tensor] = {}
            with self.timer("expert forward"), capture_inputs({n: exp_sites[n] for n in linear}, exp_out) as cap_exp:
                exp_hidden = family.run_block(expert_block, exp_hidden, exp_meta)
            exp.put(b, exp_hidden)
            with self.timer("drift"):
                before.update(uncalibrated, exp_hidden, family.valid_token_mask(meta, uncalibrated))
            if upstream is not None:
                # The block still holds its merged weights: this advances the upstream trajectory.
                up_hidden, up_meta = upstream.get(b)
                with self.timer("upstream forward"):
                    up_hidden = family.run_block(block, up_hidden, up_meta)
                upstream.put(b, up_hidden)
            with self.timer("moments"):
                if groups is None:
                    groups = self._group_linears(plan, cap_cal, linear, num_blocks)
                self._accumulate(
                    plan, groups, cap_cal, cap_exp, exp_out, hidden, meta, cal_sites,
                    norms, num_blocks, linear_moments, norm_moments,
                )
        return groups, linear_moments, norm_moments, before

    def _group_linears(self, plan, captured, linear, num_blocks) -> List[_LinearGroup]:
        """Modules fed the very same tensor with the same token weighting share one set of moments."""
        groups = []
        for shared in group_shared_inputs(captured, linear):
            by_profile: Dict[Hashable, List[str]] = {}
            for name in shared:
                by_profile.setdefault(self.family.weight_profile(plan.index, num_blocks, name), []).append(name)
            groups.extend(_LinearGroup(names, profile) for profile, names in by_profile.items())
        return groups

    def _accumulate(
        self, plan, groups, cap_cal, cap_exp, exp_out, hidden, meta, cal_sites, norms, num_blocks,
        linear_moments, norm_moments,
    ) -> None:
        """Add one batch's captured inputs to the task's moments."""
        family = self.family
        dtype = self.hparams.torch_accumulation_dtype
        weights_cache: Dict[Hashable, Optional[Tensor]] = {}

        def weights(profile):
            if profile not in weights_cache:
                weights_cache[profile] = family.token_weights(profile, hidden, meta)
            return weights_cache[profile]

        for gi, group in enumerate(groups):
            first = group.names[0]
            if gi not in linear_moments:
                dim = cap_cal[first].shape[-1]
                out_dims = {n: cal_sites[n].out_features for n in group.names}
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
            site = cal_sites[name]
            if name not in norm_moments:
                norm_moments[name] = NormInputMoments(site.dim, site.normalizer(), dtype, self.device)
            norm_moments[name].update(cap_cal[name], weights(family.weight_profile(plan.index, num_blocks, name)))

    def _finalize_task(self, plan, task, groups, lin, norms, sums_bytes: int = 0):
        """One task's moments, reduced across ranks and checked: (linear stats per group, norm stats per name)."""
        held = sum(m.nbytes() for m in itertools.chain(lin.values(), norms.values())) + sums_bytes
        self.statistics_bytes = max(self.statistics_bytes, held)
        linear = {}
        for gi, moments in lin.items():
            linear[gi] = stats = moments.finalize(self.reduce)
            what = f"the input moments of {', '.join(plan.modules[n][0] for n in groups[gi].names)} (task {task})"
            for tensor in stats.tensors():
                check_finite(tensor, what)
        normed = {}
        for name, moments in norms.items():
            normed[name] = stats = moments.finalize(self.reduce)
            check_finite(stats.second_moment, f"the normalised-input moments of {plan.modules[name][0]} (task {task})")
        return linear, normed

    @staticmethod
    def _add_task(groups, finalized, exp_sites, sums, hp: FeatCalHParams) -> None:
        """Add one task's finalised moments to a block's sums (``_BlockSums``, or the selection's held-out sums)."""
        linear, normed = finalized
        for gi, stats in linear.items():
            sums.add_linear(gi, groups[gi], stats, exp_sites, hp, hp.calibrate_bias)
        for name, stats in normed.items():
            sums.add_norm(name, stats, exp_sites[name])
        sums.num_tasks += 1

    def _fold_task(self, plan, task, groups, lin, norms, exp_sites, sums: _BlockSums, hp: FeatCalHParams) -> None:
        """Finalise one task's moments (reduced across ranks), check them, add them to the block's sums."""
        finalized = self._finalize_task(plan, task, groups, lin, norms, sums.nbytes())
        self._add_task(groups, finalized, exp_sites, sums, hp)

    def _solve_block(self, plan, base_block, sums: _BlockSums, groups, hp: FeatCalHParams, consume: bool = False):
        """The block's new parameters, as (site name, attribute, value) in the order they are solved, and the solver
        methods used; nothing is written (``_write``). With ``consume`` (sums solved once), each group's sums are
        dropped as soon as its modules are solved and every value is kept in its parameter's dtype: at Llama-3.2-1B
        shape a block's float64 solutions and its sums would otherwise be most of the host-memory peak."""
        cal_sites = plan.sites
        base_sites = self.family.sites(base_block)
        updates: List[tuple] = []
        methods: Counter = Counter()

        def anchored(name, attr):
            return anchor(getattr(cal_sites[name], attr), getattr(base_sites[name], attr).to(self.device), hp.rho)

        def update(name, attr, value):
            if consume:  # the values _write would copy in anyway
                value = value.to(getattr(cal_sites[name], attr).dtype)
            updates.append((name, attr, value))

        for gi, group in enumerate(groups or []):
            for name in group.names:
                full = plan.modules[name][0]
                site = cal_sites[name]
                result = solve_linear_weight(sums.gram[gi], sums.target[name], anchored(name, "weight"), hp.lambda_, hp.eps)
                check_finite(result.solution, f"the solved weight of {full}")
                methods[result.method] += 1
                update(name, "weight", result.solution)
                if hp.calibrate_bias and site.bias is not None and name in sums.bias_target:
                    bias = solve_bias(
                        sums.omega[gi],
                        sums.bias_target[name],
                        sums.mean_cal[gi],
                        result.solution,
                        anchored(name, "bias"),
                        hp.lambda_,
                    )
                    check_finite(bias, f"the solved bias of {full}")
                    update(name, "bias", bias)
            if consume:
                sums.drop_group(gi, group.names)
        for name, entry in sums.norm.items():
            full, kind = plan.modules[name]
            gamma_anchor = anchored(name, "weight")
            if "r_beta" in entry:
                gamma, beta = solve_layernorm_affine(
                    entry["q"], entry["z"], entry["r_gamma"], entry["r_beta"], sums.num_tasks,
                    gamma_anchor, anchored(name, "bias"), hp.lambda_, hp.eps,
                )
                check_finite(beta, f"the solved shift of {full}")
                update(name, "bias", beta)
            else:
                gamma = solve_norm_scale(entry["q"], entry["r_gamma"], sums.num_tasks, gamma_anchor, hp.lambda_, hp.eps)
            check_finite(gamma, f"the solved scale of {full}")
            update(name, "weight", gamma)
        return updates, dict(methods)

    @staticmethod
    def _write(plan, updates) -> None:
        # Load everything together: no site of this block saw a partially updated block.
        for name, attr, value in updates:
            plan.sites[name].write(**{attr: value})

    # ---- the whole model ----------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        model: nn.Module,
        base: nn.Module,
        experts: Mapping[str, nn.Module],
        task_batches: Mapping[str, Iterable[Any]],
        heldout_batches: Optional[Mapping[str, Iterable[Any]]] = None,
    ) -> Dict[str, Any]:
        """Calibrate ``model`` in place (it is moved to the device) and return a report. ``heldout_batches``
        (with a ``selector`` only): each task's held-out examples, streamed beside the fit ones and never fitted."""
        family, hp = self.family, self.hparams
        tasks = list(experts)
        missing = [t for t in tasks if t not in task_batches]
        if missing:
            raise ValueError(f"no calibration batches for task(s) {missing}")
        if (heldout_batches is None) != (self.selector is None):
            raise ValueError("held-out batches go with a selector, and a selector needs them")
        if self.schedule is not None and len(self.schedule) != len(family.blocks(model)):
            raise ValueError(f"a schedule of {len(self.schedule)} hyperparameter sets for {len(family.blocks(model))} blocks")
        plans = plan_blocks(family, model, hp)
        for module in (model, base, *experts.values()):
            module.eval()
        model.to(self.device)
        blocks = family.blocks(model)
        base_blocks = family.blocks(base)
        expert_blocks = {t: family.blocks(experts[t]) for t in tasks}
        num_blocks = len(blocks)

        started = time.perf_counter()
        options = self.stream_options
        budget = options.device_budget(self.device, block_reserve_bytes(blocks, hp.torch_accumulation_dtype))
        # Leaving the store drops every stream and removes its spill folder, also when calibration raises.
        with StreamStore(self.device, budget, options.spill, options.spill_dir, timer=self.timer) as store:
            streams: Dict[str, tuple] = {}
            for task in tqdm(tasks, desc="FeatCal: embedding calibration inputs", disable=not self.progress):
                streams[task] = self._embed(model, experts[task], task_batches[task], store)
            heldout: Dict[str, tuple] = {}
            for task in tasks if heldout_batches is not None else ():
                heldout[task] = self._embed(model, experts[task], heldout_batches[task], store, upstream=False)

            report_blocks = []
            bar = tqdm(range(num_blocks), desc="FeatCal: calibrating blocks", disable=not self.progress)
            for index in bar:
                entry = self._calibrate_block(
                    plans[index], model, blocks[index], base_blocks[index], experts,
                    {t: expert_blocks[t][index] for t in tasks}, streams, num_blocks, heldout,
                )
                report_blocks.append(entry)
                self._log_block(entry)
                drift = entry["drift"]
                mean_after = sum(d["after"]["cosine"] for d in drift.values()) / len(drift)
                bar.set_postfix(cos_after=f"{mean_after:.4f}")
            stream_report = {**store.report(), "device_budget": "auto" if options.auto else "option"}

        return {
            "family": family.name,
            "family_options": dict(family.option_values),
            "tasks": tasks,
            "num_blocks": num_blocks,
            "seconds": time.perf_counter() - started,
            "phase_seconds": dict(self.timer.seconds) if self.timer.enabled else None,
            "statistics_bytes": self.statistics_bytes,
            "streams": stream_report,
            "blocks": report_blocks,
        }

    def _calibrate_block(self, plan, model, block, base_block, experts, expert_blocks, streams, num_blocks, heldout):
        """Snapshot, solve and load one block, then advance the streams past it; return the block's report entry."""
        family = self.family
        index = plan.index
        hp = self.hparams_at(index)
        block_started = time.perf_counter()
        selection = None
        for task, (cal, exp, upstream) in itertools.chain(streams.items(), heldout.items()):
            self._enter_block(model, index, cal)
            self._enter_block(experts[task], index, exp)
            if upstream is not None:
                self._enter_block(model, index, upstream)

        sums, groups = _BlockSums(), None
        before_meters: Dict[str, Any] = {}
        if plan.modules and self.selector is not None:
            selection = self.selector.select_block(self, plan, block, base_block, expert_blocks, streams, heldout,
                                                   num_blocks, before_meters)
            methods = selection.pop("solver")
        elif plan.modules:
            for task, expert_block in expert_blocks.items():
                exp_sites = family.sites(expert_block)
                with on_device([expert_block], self.device):
                    groups, lin, norms, before_meters[task] = self._snapshot_task(
                        plan, block, expert_block, exp_sites, streams[task], num_blocks, groups
                    )
                    with self.timer("moments"):
                        self._fold_task(plan, task, groups, lin, norms, exp_sites, sums, hp)
                    del lin, norms  # before the next task's moments exist
            with self.timer("solve"), on_device([base_block], self.device):
                updates, methods = self._solve_block(plan, base_block, sums, groups, hp, consume=True)
            self._write(plan, updates)
        else:
            # Nothing to fit here, but the expert and upstream trajectories still advance.
            methods = {}
            for task, (_, exp, upstream) in itertools.chain(streams.items(), heldout.items()):
                with on_device([expert_blocks[task]], self.device):
                    self._advance(expert_blocks[task], exp)
                if upstream is not None:
                    self._advance(block, upstream)
        del sums
        for cal, _, _ in heldout.values():  # the held-out calibrated streams enter the next block calibrated too
            self._advance(block, cal)

        drift = {}
        for task, (cal, exp, upstream) in streams.items():
            after, beside = DriftMeter(), DriftMeter()
            for b in range(len(cal)):
                hidden, meta = cal.get(b)
                with self.timer("advance"):
                    hidden = family.run_block(block, hidden, meta)
                cal.put(b, hidden)
                reference = exp.hidden(b)
                upstream_hidden = None if upstream is None else upstream.hidden(b)
                with self.timer("drift"):
                    mask = family.valid_token_mask(meta, hidden)
                    after.update(hidden, reference, mask)
                    if upstream_hidden is not None:
                        beside.update(upstream_hidden, reference, mask)
            drift[task] = {"after": after.result(self.reduce)}
            if task in before_meters:
                drift[task]["before"] = before_meters[task].result(self.reduce)
            if upstream is not None:
                drift[task]["upstream"] = beside.result(self.reduce)
        entry = {
            "block": index,
            "modules": [full for full, _ in plan.modules.values()],
            "solver": methods,
            "seconds": time.perf_counter() - block_started,
            "drift": drift,
        }
        if self.schedule is not None:
            entry["hparams"] = {k: getattr(hp, k) for k in ("lambda_", "rho", "alpha")}
        if selection is not None:
            entry["selection"] = selection
        return entry

    def _log_block(self, entry: Dict[str, Any]) -> None:
        index = entry["block"]
        summary = []
        metrics: Dict[str, float] = {"featcal/block_seconds": entry["seconds"]}
        for task, drift in entry["drift"].items():
            for when, values in drift.items():
                for metric, value in values.items():
                    metrics[f"featcal/drift_{when}_{metric}/{task}"] = value
            before = drift.get("before", {}).get("l2", float("nan"))
            summary.append(f"{task}: l2 {before:.4g} -> {drift['after']['l2']:.4g}")  # this block: uncalibrated -> calibrated
        log.info("FeatCal block %d (%.2fs): %s", index, entry["seconds"], "; ".join(summary))
        if self.log_fn is not None:
            self.log_fn(metrics, index)
