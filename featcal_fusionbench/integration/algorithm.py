"""FeatCalAlgorithm: the FusionBench method (``method=featcal``)."""

from __future__ import annotations

import copy
import logging
import os
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Mapping, Optional, Union

from fusion_bench import BaseAlgorithm, BaseModelPool, auto_register_config
from fusion_bench.mixins import LightningFabricMixin, SimpleProfilerMixin

from ..autoselect.options import GENERATION_FEWEST_MEASURED, SITE_FEWEST_MEASURED, SelectionOptions
from ..autoselect.search import alpha_site, auto_calibrate
from ..core.hparams import DEFAULTS, FeatCalHParams
from ..core.sampling import check_split_sizes, heldout_split
from ..engine.loop import FeatCalEngine
from ..engine.plan import plan_blocks
from ..engine.streams import StreamOptions
from ..families import checked_options, family_for
from ..models.checks import check_same_architecture
from ..models.sinks import CheckpointSink, MemorySink
from ..reports.drift import DRIFT_PICTURE, write_drift_picture
from .data import calibration_source, select_calibration_data, shard
from .hub_access import check_path_option
from .memory import choose as choose_models_in_memory
from .memory import resolve_setting
from .fingerprint import data_fingerprint, digest, models_fingerprint
from .out_of_core import (OneAtATime, check_out_of_core, load_lazy_merged, map_large_allocations, output_path,
                          save_config_and_tokenizer, upstream_path)
from .post_merging import PostMergingMixin, peak_memory
from .upstream import load_saved_model

log = logging.getLogger(__name__)

REPORT_NAME = "featcal_report.json"


@auto_register_config
class FeatCalAlgorithm(PostMergingMixin, LightningFabricMixin, SimpleProfilerMixin, BaseAlgorithm):
    """Feature Calibration for post-merging models (closed form, forward order).

    The merged model comes from ``merged_model_path``, else the pool's
    ``_merged_``, else the nested ``upstream`` method run on the pool; the
    pool's ``_pretrained_`` is the base and its other models are the experts,
    each calibrated on ``num_calibration_examples`` examples of its own task's
    train split, or of ``calibration_datasets[task]`` (a dataset config) where
    given: FusionBench's FLAN-T5 GLUE pools have no train splits. Returns the
    calibrated model (same class, keys and shapes as the merged one), or with
    ``return_upstream`` a dict that FusionBench evaluates as two models:
    ``{"upstream": ..., "featcal": ...}``. ``family_options`` go to the model's
    family (e.g. CLIP's ``last_block_patch_token_weight``). ``models_in_memory``
    (``integration.memory``): ``all`` whole; ``merged``: the base and experts read from their safetensors checkpoints
    one block at a time, only the merged model held whole; ``none``: no model whole, the merged model read block by
    block too (from ``merged_model_path``, ``_merged_``, or FusionBench's Task Arithmetic or TIES computed tensor by
    tensor) and each calibrated block written as it finishes to the program's ``merged_model_save_path`` (else
    ``<log_dir>/featcal_model``; with ``return_upstream`` the upstream beside it, ``..._upstream``): the returned
    model is that folder loaded for the task pool (None without a task pool), and a stopped run started again with
    the same command resumes after its last written block; ``auto`` (default): chosen from the checkpoints' sizes
    against the host's available memory. ``lazy_loading`` / ``out_of_core``: the former names of ``merged`` /
    ``none``. ``stream_device_bytes``
    (bytes, or e.g. "8GB"; null / "auto": from the device's free memory, unbounded on
    CPU) bounds the hidden-state streams kept on the device; batches beyond it go to
    ``stream_spill`` ("host": pinned host memory; "disk": a temporary folder in
    ``stream_spill_dir``, removed at the end). ``auto_select`` (false: off, the given lambda_ / rho / alpha;
    true or a mapping of ``autoselect.options.SelectionOptions``): choose them without labels on calibration examples
    each candidate's solve did not see (criterion ``objective``: per block, cross-fitted over folds of each task's
    examples, in the one calibration pass, each block then solved with its choice on all examples; ``drift`` /
    ``agreement`` / ``site``: a calibration per candidate on a fit part, scored on a held-out part, in memory).
    """

    method_name = "FeatCal"

    def __init__(
        self,
        upstream: Optional[Any] = None,
        merged_model_path: Optional[str] = None,
        lambda_: float = DEFAULTS.lambda_,
        rho: float = DEFAULTS.rho,
        alpha: float = DEFAULTS.alpha,
        eps: float = DEFAULTS.eps,
        num_calibration_examples: int = DEFAULTS.num_calibration_examples,
        batch_size: int = DEFAULTS.batch_size,
        seed: int = DEFAULTS.seed,
        calibrate_bias: bool = DEFAULTS.calibrate_bias,
        calibrate_layernorm: bool = DEFAULTS.calibrate_layernorm,
        module_regex: Optional[str] = DEFAULTS.module_regex,
        accumulation_dtype: str = DEFAULTS.accumulation_dtype,
        family_options: Optional[Mapping[str, Any]] = None,
        track_upstream_drift: bool = False,
        return_upstream: bool = False,
        calibration_datasets: Optional[Mapping[str, Any]] = None,
        models_in_memory: str = "auto",
        lazy_loading: Optional[bool] = None,
        out_of_core: Optional[bool] = None,
        stream_device_bytes: Union[None, int, str] = None,
        stream_spill: str = "host",
        stream_spill_dir: Optional[str] = None,
        last_block_patch_token_weight: Optional[float] = None,
        auto_select: Union[bool, None, Mapping[str, Any]] = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # Validates every hyperparameter now, before any model or data is loaded.
        check_path_option("method.merged_model_path", merged_model_path)
        arguments = locals()
        self.featcal_hparams = FeatCalHParams(**{k: arguments[k] for k in FeatCalHParams.__dataclass_fields__})
        self.stream_options = StreamOptions(stream_device_bytes, stream_spill, stream_spill_dir)
        self.family_options = _family_options(family_options, last_block_patch_token_weight)
        self.selection_options = SelectionOptions.parse(auto_select)
        self.in_memory = resolve_setting(models_in_memory, lazy_loading, out_of_core)
        self._alpha_site = None  # alpha_criterion site's feature site, built with the models

    @property
    def streams_merged(self) -> bool:
        """Out of core (``models_in_memory=none``): the merged model read and the calibrated one written a block at
        a time."""
        return self.in_memory == "none"

    def run(self, modelpool: BaseModelPool):
        if not isinstance(modelpool, BaseModelPool):
            modelpool = BaseModelPool(modelpool)
        # Everything that can be wrong with the input is checked before any model is read.
        tasks = self.check_pool(modelpool)
        self._choose_models_in_memory(modelpool, tasks)
        output = self._check(modelpool, tasks)
        datasets = self._calibration_data(modelpool, tasks)
        base, experts, family = self._models(modelpool, tasks)
        merged, source = self._source(modelpool, base, experts)
        upstream_copy = copy.deepcopy(merged) if self.return_upstream and not self.streams_merged else None
        with self._sinks(output, modelpool, merged, family, source) as (sink, upstream_sink):
            report = self._calibrate(modelpool, family, merged, base, experts, datasets, sink, upstream_sink)
            written, upstream_written = sink.finish(), upstream_sink.finish()
        self._report(report, source, tasks, written, upstream_written)
        if not self.streams_merged:
            return {"upstream": upstream_copy, "featcal": merged, "featcal_calibration": _summary(report)} \
                if self.return_upstream else merged
        return self._load_written(written, upstream_written, modelpool, base, report)

    # ---- the steps of run -------------------------------------------------------------------------------------

    def _choose_models_in_memory(self, modelpool, tasks) -> None:
        if self.in_memory != "auto":
            return

        def merged_streams():
            try:
                check_out_of_core(modelpool, self.upstream, self.merged_model_path, selection=self.selection_options)
            except ValueError:
                return False
            return True

        self.in_memory, why = choose_models_in_memory(modelpool, tasks, merged_streams)
        log.info("models_in_memory=auto: %s (%s)", self.in_memory, why)

    def _check(self, modelpool, tasks) -> Optional[str]:
        """Refuse what cannot run, before any model is read; the output folder out of core (else None)."""
        hp, world_size = self.featcal_hparams, self.fabric.world_size
        output = None
        if self.streams_merged:
            check_out_of_core(modelpool, self.upstream, self.merged_model_path, selection=self.selection_options)
            program = self._program
            output = output_path(getattr(program, "merged_model_save_path", None),
                                 getattr(program, "log_dir", None) or self.log_dir)
            if world_size > 1:  # a log folder named by the time may differ between ranks: rank 0's is written
                output = self.fabric.broadcast(output, src=0)
            map_large_allocations()
        if self.selection_options is not None:
            if world_size > 1 and self.selection_options.criterion != "objective":
                # Their held-out scores are not all-reduced yet: ranks could choose differently.
                raise ValueError(
                    f"auto_select criterion {self.selection_options.criterion!r} runs on one device only; "
                    "use criterion objective (its moments are all-reduced) on several"
                )
            options = self.selection_options
            if world_size > 1 and options.alpha_criterion == "drift":
                raise ValueError(
                    f"auto_select alpha_criterion {options.alpha_criterion!r} runs on one device only (its held-out "
                    "scores are not all-reduced); set auto_select.alpha_criterion=none (or site, for CLIP, "
                    "OpenCLIP and T5), or fix method.alpha, on several"
                )
            if options.criterion == "objective":
                options.check_fold_sizes(hp.num_calibration_examples, world_size, tasks)
                if options.alpha_criterion == "drift":
                    check_split_sizes(hp.num_calibration_examples, 1, options.heldout_fraction, tasks)
                    fit, _ = heldout_split(hp.num_calibration_examples, options.heldout_fraction, 0, tasks[0])
                    options.check_fold_sizes(len(fit), 1, tasks)  # the alpha stage's folds of the fit part
                elif options.alpha_criterion == "site":
                    options.check_site_sizes(hp.num_calibration_examples, world_size, tasks)
            elif options.criterion == "site":
                options.check_site_sizes(hp.num_calibration_examples, world_size, tasks)
                if options.few_examples == "objective" and hp.num_calibration_examples < max(
                        SITE_FEWEST_MEASURED, GENERATION_FEWEST_MEASURED):  # the family's threshold is known later
                    try:
                        options.fallback().check_fold_sizes(hp.num_calibration_examples, world_size, tasks)
                    except ValueError as error:
                        raise ValueError(f"auto_select criterion site with {hp.num_calibration_examples} examples "
                                         f"per task may fall back to criterion objective (few_examples: objective), "
                                         f"whose folds fail: {error}; or set auto_select.few_examples=site") from None
            else:
                check_split_sizes(hp.num_calibration_examples // world_size, 1, options.heldout_fraction, tasks)
        return output

    def _calibration_data(self, modelpool, tasks) -> Dict[str, Any]:
        """Each task's calibration examples, all of them (a dataset that is missing a field or too small fails
        before any model is loaded): each rank calibrates on its shard of them (``_calibrate``), and with several
        devices the moment sums are all-reduced before each solve, so every rank solves the same systems."""
        hp = self.featcal_hparams
        with self.profile("load calibration data"):
            datasets = select_calibration_data(
                modelpool, tasks, hp.num_calibration_examples, hp.seed, calibration_datasets=self.calibration_datasets
            )
            self._data_fingerprint = data_fingerprint(datasets) if self.streams_merged else None
            return datasets

    def _models(self, modelpool, tasks):
        with self.profile("load models"):
            base, experts = self.load_base_and_experts(modelpool, tasks, lazy=self.in_memory != "all")
            family = family_for(base, self.family_options)
            family.check_models(modelpool, base)
            plan_blocks(family, base, self.featcal_hparams)
            options = self.selection_options
            # a model without the feature site fails here, before the merge
            self._alpha_site = alpha_site(family, modelpool, base) if options is not None and \
                options.reads_site else None
        return base, experts, family

    def _source(self, modelpool, base, experts):
        """The merged model: whole in memory, or (out of core) a lazy model read or computed block by block."""
        with self.profile("upstream merge"):
            if not self.streams_merged:
                return self.load_merged(modelpool, base, experts)
            merged, source = load_lazy_merged(modelpool, self.upstream, self.merged_model_path, base, experts)
            check_same_architecture(base, merged, f"the merged model ({source})")
            return merged, source

    @contextmanager
    def _sinks(self, output, modelpool, merged, family, source):
        """Where the calibrated blocks go (and the upstream's, with ``return_upstream``): memory, or out of core
        checkpoints written block by block by rank 0, resumable."""
        if not self.streams_merged:
            yield MemorySink(), MemorySink()
            return
        blocks = family.blocks(merged)
        fingerprint = self._fingerprint(modelpool, source)
        options = dict(save_extra=save_config_and_tokenizer(merged, modelpool), writer=self.fabric.is_global_zero,
                       barrier=self.fabric.barrier if self.fabric.world_size > 1 else None)
        with ExitStack() as stack:
            sink = stack.enter_context(CheckpointSink(output, merged, blocks, fingerprint=fingerprint, **options))
            upstream_sink = MemorySink()
            if self.return_upstream:
                upstream_sink = stack.enter_context(CheckpointSink(
                    upstream_path(output), merged, blocks, fingerprint={**fingerprint, "written model": "upstream"},
                    label="the upstream model", **options))
            yield sink, upstream_sink

    def _fingerprint(self, modelpool, source) -> Dict[str, str]:
        """What a resumed run must share with the stopped one."""
        hp = self.featcal_hparams
        configuration = {"hparams": {k: getattr(hp, k) for k in hp.__dataclass_fields__},
                         "family_options": self.family_options, "auto_select": repr(self.selection_options),
                         "upstream": source, "world_size": self.fabric.world_size}
        return {"configuration": digest(configuration), "calibration data": self._data_fingerprint,
                "input models": models_fingerprint(modelpool, self.merged_model_path)}

    def _calibrate(self, modelpool, family, merged, base, experts, datasets, sink, upstream_sink):
        hp, world_size = self.featcal_hparams, self.fabric.world_size

        def make_engine(hparams, engine_family, search=False, **kwargs):
            # auto_select's search runs (drift / agreement) neither log per-block metrics, track the upstream nor
            # write anything: only the calibration that is kept does.
            final = not search
            return FeatCalEngine(
                engine_family,
                hparams,
                self.fabric.device,
                reduce=self._all_reduce if world_size > 1 else None,
                track_upstream=self.track_upstream_drift and final,
                log_fn=self.log_metrics if self.fabric.is_global_zero and final else None,
                progress=self.fabric.is_global_zero and final,
                streams=self.stream_options,
                sink=sink if final else None,
                upstream_sink=upstream_sink if final else None,
                **kwargs,
            )

        def batches_of(dataset):
            return family.batches(modelpool, dataset, hp.batch_size)

        rank = self.fabric.global_rank
        with self.profile("calibration"):
            if self.selection_options is not None:
                # the folds are the whole set's, each shared out across the ranks: every rank sees every fold, and
                # any number of devices cross-fits on the folds one device does
                return auto_calibrate(
                    make_engine, lambda extra: family_for(base, {**self.family_options, **extra}),
                    self.selection_options, hp, merged, base, experts, datasets, batches_of, self.fabric.device,
                    shard=(rank, world_size), site=self._alpha_site,
                )
            shards = {t: shard(d, rank, world_size) for t, d in datasets.items()}
            return make_engine(hp, family).run(merged, base, experts, {t: batches_of(d) for t, d in shards.items()})

    def _report(self, report, source, tasks, written, upstream_written) -> None:
        hp = self.featcal_hparams
        report.update(
            {
                "upstream": source,
                "hparams": {k: getattr(hp, k) for k in hp.__dataclass_fields__},
                "calibration_data": {t: calibration_source(t, "train", self.calibration_datasets) for t in tasks},
                "device": str(self.fabric.device),
                "world_size": self.fabric.world_size,
                "models_in_memory": self.in_memory,
                **peak_memory(self.fabric.device),
            }
        )
        if written is not None:
            report["output"] = {"path": str(written)}
            if upstream_written is not None:
                report["output"]["upstream_path"] = str(upstream_written)
        resumed = [entry["block"] for entry in report["blocks"] if entry.get("resumed")]
        if resumed:
            report["resumed_blocks"] = resumed
        self.save_report(REPORT_NAME, report)
        self._save_drift_picture(report)
        self.print_profile_summary("FeatCal profile")

    def _save_drift_picture(self, report: Dict[str, Any]) -> None:
        log_dir = self.log_dir
        if log_dir is None or not self.fabric.is_global_zero:
            return
        path = os.path.join(log_dir, DRIFT_PICTURE)
        try:
            write_drift_picture(report, path)
        except Exception as error:  # the calibrated model and its report are done: a picture never costs them
            log.warning("could not draw %s: %s: %s", path, type(error).__name__, error)
        else:
            log.info("FeatCal drift picture saved to %s", path)

    def _load_written(self, written, upstream_written, modelpool, base, report):
        """The written model(s) for the program's task pool (None without one), in the base's dtype and with the
        pool's ``model_kwargs.device_map`` where it sets one, one at a time; the program is told not to save again."""
        program = self._program
        if program is not None and getattr(program, "merged_model_save_path", None) is not None:
            program.merged_model_save_path = None  # already written, block by block
        if program is not None and getattr(program, "_taskpool", None) is None:
            log.info("no task pool: the calibrated model stays on disk, at %s", written)
            return None
        device_map = (getattr(modelpool, "model_kwargs", None) or {}).get("device_map")

        def load(path):
            return load_saved_model(str(path), base, device_map=device_map)

        if not self.return_upstream:
            return load(written)
        return OneAtATime({"upstream": lambda: load(upstream_written), "featcal": lambda: load(written)},
                          {"featcal_calibration": _summary(report)})

    def _all_reduce(self, tensor):
        return self.fabric.all_reduce(tensor.to(self.fabric.device), reduce_op="sum").to(tensor.device)


def _family_options(family_options, last_block_patch_token_weight) -> Dict[str, Any]:
    """``family_options`` as a plain dict, with the pre-registry top-level CLIP flag folded in."""
    options = checked_options(family_options)
    if last_block_patch_token_weight is not None:
        warnings.warn(
            "method.last_block_patch_token_weight is deprecated: use method.family_options.last_block_patch_token_weight",
            FutureWarning,
            stacklevel=3,
        )
        given = options.setdefault("last_block_patch_token_weight", last_block_patch_token_weight)
        if given != last_block_patch_token_weight:
            raise ValueError(
                f"last_block_patch_token_weight={last_block_patch_token_weight} contradicts "
                f"family_options.last_block_patch_token_weight={given}; set only the latter"
            )
    return options


def _summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """Calibration time and last-block drift, small enough for FusionBench's report."""
    last = report["blocks"][-1]["drift"]
    return {
        "seconds": report["seconds"],
        "peak_rss_bytes": report["peak_rss_bytes"],
        "upstream": report["upstream"],
        "calibration_data": report["calibration_data"],
        "last_block_drift": last,
    }


__all__ = ["FeatCalAlgorithm"]
