"""FeatCalAlgorithm: the FusionBench method (``method=featcal``)."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Dict, Mapping, Optional, Union

from fusion_bench import BaseAlgorithm, BaseModelPool, auto_register_config
from fusion_bench.mixins import LightningFabricMixin, SimpleProfilerMixin

from ..autoselect.options import SelectionOptions
from ..autoselect.search import auto_calibrate
from ..core.hparams import DEFAULTS, FeatCalHParams
from ..core.sampling import check_split_sizes
from ..engine.loop import FeatCalEngine
from ..engine.plan import plan_blocks
from ..engine.streams import StreamOptions
from ..families import checked_options, family_for
from ..models.checkpoint_writer import CheckpointWriter
from ..models.checks import check_same_architecture
from .data import calibration_source, select_calibration_data, shard
from .hub_access import check_path_option
from .out_of_core import (block_sink, check_out_of_core, load_lazy_merged, map_large_allocations, model_bytes,
                          output_path, save_config_and_tokenizer, write_rest)
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
    family (e.g. CLIP's ``last_block_patch_token_weight``). ``lazy_loading``:
    the base and experts are read from their safetensors checkpoints one block
    at a time, so that only the merged model is held whole. ``stream_device_bytes``
    (bytes, or e.g. "8GB"; null / "auto": from the device's free memory, unbounded on
    CPU) bounds the hidden-state streams kept on the device; batches beyond it go to
    ``stream_spill`` ("host": pinned host memory; "disk": a temporary folder in
    ``stream_spill_dir``, removed at the end). ``auto_select`` (false: off, the given lambda_ / rho / alpha;
    true or a mapping of ``autoselect.options.SelectionOptions``): choose them without labels on a held-out part of each
    task's calibration examples, then calibrate on all of them with the choice (``autoselect``).
    ``out_of_core``: no model is ever whole in memory: the merged model is read block by block too (from
    ``merged_model_path``, ``_merged_``, or FusionBench's Task Arithmetic computed tensor by tensor) and each calibrated
    block is written as it finishes to the program's ``merged_model_save_path`` (else ``<log_dir>/featcal_model``);
    the returned model is that folder loaded for the task pool (None without a task pool: nothing is loaded whole).
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
        lazy_loading: bool = False,
        out_of_core: bool = False,
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

    def run(self, modelpool: BaseModelPool):
        if not isinstance(modelpool, BaseModelPool):
            modelpool = BaseModelPool(modelpool)
        hp = self.featcal_hparams

        # Everything that can be wrong with the input is checked before the upstream merge runs.
        tasks = self.check_pool(modelpool)
        world_size = self.fabric.world_size
        if self.out_of_core:
            check_out_of_core(modelpool, self.upstream, self.merged_model_path, return_upstream=self.return_upstream,
                              auto_select=self.selection_options is not None, world_size=world_size)
            program = self._program
            output = output_path(getattr(program, "merged_model_save_path", None),
                                 getattr(program, "log_dir", None) or self.log_dir)
            map_large_allocations()
        if self.selection_options is not None:
            if world_size > 1 and self.selection_options.criterion != "objective":
                # Their held-out scores are not all-reduced yet: ranks could choose differently.
                raise ValueError(
                    f"auto_select criterion {self.selection_options.criterion!r} runs on one device only; "
                    "use criterion objective (its moments are all-reduced) on several"
                )
            share = hp.num_calibration_examples // world_size
            check_split_sizes(share, 1, self.selection_options.heldout_fraction, tasks)
        # The data first: a dataset that is missing a field or too small fails before any model is loaded.
        with self.profile("load calibration data"):
            datasets = select_calibration_data(
                modelpool, tasks, hp.num_calibration_examples, hp.seed, calibration_datasets=self.calibration_datasets
            )
            # Several devices: each rank streams a disjoint shard of every task; the moment sums are
            # all-reduced before each solve, so every rank solves the same systems.
            rank = self.fabric.global_rank
            datasets = {t: shard(d, rank, world_size) for t, d in datasets.items()}
        with self.profile("load models"):
            base, experts = self.load_base_and_experts(modelpool, tasks, lazy=self.lazy_loading or self.out_of_core)
            family = family_for(base, self.family_options)
            family.check_models(modelpool, base)
            plan_blocks(family, base, hp)

        with self.profile("upstream merge"):
            if self.out_of_core:
                merged, source = load_lazy_merged(modelpool, self.upstream, self.merged_model_path, base, experts)
                check_same_architecture(base, merged, f"the merged model ({source})")
            else:
                merged, source = self.load_merged(modelpool, base, experts)
        upstream_model = copy.deepcopy(merged) if self.return_upstream else None

        def make_engine(hparams, engine_family, search=False, **kwargs):
            # auto_select's search runs neither log per-block metrics nor track the upstream: only the final run does.
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
                **kwargs,
            )

        def batches_of(dataset):
            return family.batches(modelpool, dataset, hp.batch_size)

        with self.profile("calibration"):
            if self.selection_options is not None:
                report = auto_calibrate(
                    make_engine, lambda extra: family_for(base, {**self.family_options, **extra}),
                    self.selection_options, hp, merged, base, experts, datasets, batches_of, self.fabric.device,
                )
            elif self.out_of_core:
                report = self._calibrate_out_of_core(modelpool, make_engine, family, merged, base, experts,
                                                     {t: batches_of(datasets[t]) for t in tasks}, output)
            else:
                report = make_engine(hp, family).run(merged, base, experts, {t: batches_of(datasets[t]) for t in tasks})
        report.update(
            {
                "upstream": source,
                "hparams": {k: getattr(hp, k) for k in hp.__dataclass_fields__},
                "calibration_data": {t: calibration_source(t, "train", self.calibration_datasets) for t in tasks},
                "device": str(self.fabric.device),
                "world_size": world_size,
                "lazy_loading": self.lazy_loading,
                "out_of_core": self.out_of_core,
                **peak_memory(self.fabric.device),
            }
        )
        self.save_report(REPORT_NAME, report)
        self.print_profile_summary("FeatCal profile")

        if self.return_upstream:
            return {"upstream": upstream_model, "featcal": merged, "featcal_calibration": _summary(report)}
        if self.out_of_core:
            return self._load_output(output, modelpool, base)
        return merged

    def _calibrate_out_of_core(self, modelpool, make_engine, family, merged, base, experts, batches, output):
        """Calibrate the lazy ``merged`` block by block, each block written to ``output`` as it finishes."""
        with CheckpointWriter(output, model_bytes(merged)) as writer:
            report = make_engine(self.featcal_hparams, family, block_sink=block_sink(merged, writer)).run(
                merged, base, experts, batches)
            write_rest(merged, family.blocks(merged), writer)
            writer.commit(save_config_and_tokenizer(merged, modelpool))
        log.info("the calibrated model was written to %s", output)
        report["output"] = {"path": str(writer.path), "bytes": writer.total_bytes}
        return report

    def _load_output(self, output, modelpool, base):
        """The written model for the program's task pool (None without one), in the base's dtype and with the pool's
        ``model_kwargs.device_map`` where it sets one; the program is told not to save it again."""
        program = self._program
        if program is not None and getattr(program, "merged_model_save_path", None) is not None:
            program.merged_model_save_path = None  # already written, block by block
        if program is not None and getattr(program, "_taskpool", None) is None:
            log.info("no task pool: the calibrated model stays on disk, at %s", output)
            return None
        device_map = (getattr(modelpool, "model_kwargs", None) or {}).get("device_map")
        return load_saved_model(output, base, device_map=device_map)

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
