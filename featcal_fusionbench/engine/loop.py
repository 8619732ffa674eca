"""The forward-order calibration loop (paper Algorithm 1); ``docs/architecture.md`` draws one block.

For each block, in forward order:
  1. collect: for each task, the block's step (``step.BlockStep``) runs the still-uncalibrated block on the
     calibrated prefix's hidden states and expert i's own block on expert i's; forward pre-hooks capture every
     calibrated module's input and the task's moments stream in (one set per shared input, e.g. q/k/v);
  2. choose and solve: the block's hyperparameter choice (``policy``) folds each task's moments into its sums as
     soon as the task is done (memory does not grow with the number of tasks), then solves weights (Eq. 17),
     biases (Eq. 55) and norm affines (Eq. 59). A policy that chooses by cross-fitting (``auto_select``) first
     collects each part (fold) of each task's batches apart, chooses, and the block is then collected and solved
     with the choice on all of them: one pass over the model, whatever the policy;
  3. write: the block's new parameters are loaded together, and only then do the calibrated hidden states advance
     through the calibrated block.
Experts and the base model stay where they are (host memory); only the block in use visits the device. A lazy
calibrated model (out of core, ``models.lazy``) is read block by block too: each block is read onto the device
for its turn and handed to the ``sink`` (``models.sinks``: which writes it out) before it is released. Every
task's hidden-state streams live in a ``StreamStore`` (``streams``): on the device within a byte budget, spilled to
host or disk beyond it. Everything model-specific comes from the model family (``families``): the walk, the
calibrated sites and their parameters, token weights.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.hparams import FeatCalHParams
from ..core.meters import DriftMeter
from ..core.moments import Reduce
from ..families import ModelFamily
from ..models.lazy import is_lazy
from ..models.residency import on_device
from .plan import block_reserve_bytes, plan_blocks
from .policy import PER_BLOCK, FixedChoice, FixedHParams, HParamPolicy
from .step import BlockStep, TaskStreams
from .streams import Stream, StreamOptions, StreamStore

log = logging.getLogger(__name__)

LogFn = Callable[[Dict[str, float], int], None]


class BlockSink(Protocol):
    """Where finished blocks go (``models.sinks``)."""

    def done(self, index: int) -> Optional[Dict[str, Any]]:
        """Block ``index`` as a stopped run wrote it (``state``: its tensors, ``entry``: its report), else None."""

    def block(self, index: int, block: nn.Module, entry: Optional[Mapping[str, Any]] = None) -> None: ...


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
        policy: Optional[HParamPolicy] = None,
        sink: Optional[BlockSink] = None,
        upstream_sink: Optional[BlockSink] = None,
    ):
        """``policy``: each block's lambda / rho / alpha (``engine.policy``); by default ``hparams``' own values in
        every block. A policy that ``needs_parts`` is told how each task's batches fall into parts (``run``).
        ``sink`` (``models.sinks``): each block is handed to ``sink.block(index, block, entry)`` once it is
        calibrated and every stream has left it, while its weights are still on the device; a block that
        ``sink.done(index)`` gives (a resumed run's) is not calibrated again: its written values are loaded and the
        streams advance through it. ``upstream_sink``: each block as it was read, before it is calibrated."""
        self.family = family
        self.hparams = hparams
        self.policy = policy or FixedHParams()
        self.device = torch.device(device)
        self.reduce = reduce
        self.track_upstream = track_upstream
        self.log_fn = log_fn
        self.progress = progress
        self.timer = PhaseTimer(profile, self.device)
        self.stream_options = streams or StreamOptions()
        self.statistics_bytes = 0  # peak bytes of one task's moments plus a block's sums
        self.sink = sink
        self.upstream_sink = upstream_sink
        self.parts: Dict[str, List[range]] = {}  # per task, its stream's batch ranges, one per part

    # ---- streams ------------------------------------------------------------------------------

    def _embed(self, model, expert, batches, store: StreamStore, upstream: bool = True) -> TaskStreams:
        """The task's calibrated and expert streams, and the upstream one when tracked (it starts as the calibrated)."""
        family = self.family
        cal, exp = store.stream(), store.stream()
        upstream = store.stream() if self.track_upstream and upstream else None
        # One model's stem at a time (a lazy model's is read for the pass): at LLM scale a stem is the vocabulary's
        # embedding, the largest tensor there is. The task's inputs (token ids, images) are kept for both passes.
        batches = list(batches)
        for source, streams in ((model, (cal, upstream)), (expert, (exp,))):
            with on_device(family.stem_modules(source), self.device):
                for inputs in batches:
                    with self.timer("embed"):
                        hidden, meta = family.embed(source, family.inputs_to(inputs, self.device))
                    for stream in streams:
                        if stream is not None:
                            stream.append(hidden, meta)
        if not len(cal):
            raise ValueError("a task produced no calibration batches")
        return TaskStreams(cal, exp, upstream)

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

    # ---- the whole model ----------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        model: nn.Module,
        base: nn.Module,
        experts: Mapping[str, nn.Module],
        task_batches: Mapping[str, Iterable[Any]],
        parts: Optional[Mapping[str, Sequence[int]]] = None,
    ) -> Dict[str, Any]:
        """Calibrate ``model`` in place (it is moved to the device) and return a report. ``parts`` (with a policy
        that ``needs_parts`` only): per task, how many of its ``task_batches`` (in order) make each part; each
        block's values are chosen by cross-fitting over the parts, then the block is solved with them on all."""
        family, hp = self.family, self.hparams
        tasks = list(experts)
        missing = [t for t in tasks if t not in task_batches]
        if missing:
            raise ValueError(f"no calibration batches for task(s) {missing}")
        if (parts is None) == self.policy.needs_parts:
            raise ValueError("parts of the batches go with a policy that needs them, and only with one")
        self.policy.check(len(family.blocks(model)))
        plans = plan_blocks(family, model, hp)
        for module in (model, base, *experts.values()):
            module.eval()
        if not is_lazy(model):
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
            streams: Dict[str, TaskStreams] = {}
            # With parts, a task's one stream holds them one after the other: the choice reads each part's range
            # apart, the block is then solved on all of them and every batch advances.
            self.parts = {}
            for task in tqdm(tasks, desc="FeatCal: embedding calibration inputs", disable=not self.progress):
                batches = list(task_batches[task])
                if parts is not None:
                    self.parts[task] = _ranges(task, parts[task], len(batches))
                streams[task] = self._embed(model, experts[task], batches, store)

            report_blocks = []
            bar = tqdm(range(num_blocks), desc="FeatCal: calibrating blocks", disable=not self.progress)
            for index in bar:
                with on_device([blocks[index]], self.device):  # a lazy model's block is read for its turn
                    if self.upstream_sink is not None:
                        self.upstream_sink.block(index, blocks[index])
                    args = (plans[index], model, blocks[index], {t: expert_blocks[t][index] for t in tasks}, streams)
                    written = None if self.sink is None else self.sink.done(index)
                    if written is None:
                        entry = self._calibrate_block(*args, base_blocks[index], experts, num_blocks)
                    else:
                        entry = self._replay_block(*args, experts, written)
                    if self.sink is not None:
                        self.sink.block(index, blocks[index], entry)
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

    def _enter(self, model, index, experts, streams) -> None:
        for task, task_streams in streams.items():
            self._enter_block(model, index, task_streams.calibrated)
            self._enter_block(experts[task], index, task_streams.expert)
            if task_streams.upstream is not None:
                self._enter_block(model, index, task_streams.upstream)

    def _replay_block(self, plan, model, block, expert_blocks, streams, experts, written) -> Dict[str, Any]:
        """A block a stopped run wrote: every stream advances as the run advanced it (the experts' and the
        upstream's through the blocks as read, the calibrated ones through the written values), bit for bit."""
        self._enter(model, plan.index, experts, streams)
        for task, task_streams in streams.items():
            with on_device([expert_blocks[task]], self.device):
                self._advance(expert_blocks[task], task_streams.expert)
            if task_streams.upstream is not None:
                self._advance(block, task_streams.upstream)
        state = block.state_dict()
        with torch.no_grad():
            for key, value in written["state"].items():
                state[key].copy_(value)
        for task_streams in streams.values():
            self._advance(block, task_streams.calibrated)
        return {**written["entry"], "resumed": True}

    def _calibrate_block(self, plan, model, block, expert_blocks, streams, base_block, experts, num_blocks):
        """Collect, choose, solve and load one block, then advance the streams past it; return the block's report
        entry."""
        family = self.family
        index = plan.index
        block_started = time.perf_counter()
        self._enter(model, index, experts, streams)

        before_meters: Dict[str, DriftMeter] = {}
        methods: Dict[str, int] = {}
        selection_seconds = None
        if plan.modules:
            step = BlockStep(family, plan, block, base_block, num_blocks, self.device,
                             self.hparams.torch_accumulation_dtype, self.timer, self.reduce)
            if self.policy.needs_parts:
                selection_started = time.perf_counter()
                choice = self._choose(step, base_block, expert_blocks, streams)
                selection_seconds = time.perf_counter() - selection_started
            else:
                choice = self.policy.for_block(index, self.hparams)
            for task, expert_block in expert_blocks.items():
                with on_device([expert_block], self.device):
                    fit = step.collect(task, expert_block, streams[task])
                    before_meters[task] = fit.drift_before
                    with self.timer("moments"):
                        choice.add_task(step, fit, family.sites(expert_block))
                    del fit  # before the next task's moments exist
            with self.timer("solve"), on_device([base_block], self.device):
                solution = choice.solve(step)
            step.write(solution)
            methods = solution.methods
            self.statistics_bytes = max(self.statistics_bytes, step.peak_bytes)
            del step, solution
        else:
            choice = FixedChoice(self.hparams)
            # Nothing to fit here, but the expert and upstream trajectories still advance.
            for task, task_streams in streams.items():
                with on_device([expert_blocks[task]], self.device):
                    self._advance(expert_blocks[task], task_streams.expert)
                if task_streams.upstream is not None:
                    self._advance(block, task_streams.upstream)

        drift = {}
        for task, task_streams in streams.items():
            cal, exp, upstream = task_streams.calibrated, task_streams.expert, task_streams.upstream
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
        return {
            "block": index,
            "modules": [full for full, _ in plan.modules.values()],
            "solver": methods,
            "seconds": time.perf_counter() - block_started,
            "drift": drift,
            **choice.report,
            **({} if selection_seconds is None else {"selection_seconds": selection_seconds}),
        }

    def _choose(self, step: BlockStep, base_block, expert_blocks, streams) -> FixedChoice:
        """The block's values chosen by cross-fitting (``policy.needs_parts``): each part of each task's batches is
        collected apart, the expert streams left at the block's input; the returned choice solves the block with
        those values on all of the task's batches."""
        selection = self.policy.for_block(step.plan.index, self.hparams)
        for task, expert_block in expert_blocks.items():
            with on_device([expert_block], self.device):
                sites = self.family.sites(expert_block)
                for part, batches in enumerate(self.parts[task]):
                    moments = step.collect(task, expert_block, streams[task], batches, advance=False)
                    with self.timer("moments"):
                        selection.add(part, step, moments, sites)
                    del moments  # one task part's moments at a time
        with self.timer("selection"), on_device([base_block], self.device):
            chosen = selection.choose(step)
        return FixedChoice(chosen, {"hparams": {k: getattr(chosen, k) for k in PER_BLOCK}, **selection.report})

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


def _ranges(task: str, sizes: Sequence[int], total: int) -> List[range]:
    """A task's batch ranges, one per part, from the parts' sizes (each at least one batch, all of them in all)."""
    sizes = list(sizes)
    if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != total:
        raise ValueError(f"task {task!r}: parts of {sizes} batches do not split its {total} batches into two or more")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
