"""FeatCalAlgorithm: the FusionBench method (``method=featcal``)."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any, Dict, Optional

from fusion_bench import BaseAlgorithm, BaseModelPool, auto_register_config
from fusion_bench.mixins import LightningFabricMixin, SimpleProfilerMixin

from .architectures import adapter_class_for
from .checks import check_same_architecture
from .data import check_train_splits, select_calibration_data
from .engine import FeatCalEngine, plan_blocks
from .hparams import FeatCalHParams
from .upstream import check_upstream_source, load_merged_model

log = logging.getLogger(__name__)

REPORT_NAME = "featcal_report.json"


@auto_register_config
class FeatCalAlgorithm(LightningFabricMixin, SimpleProfilerMixin, BaseAlgorithm):
    """Feature Calibration for post-merging models (closed form, forward order).

    The merged model comes from ``merged_model_path``, else the pool's
    ``_merged_``, else the nested ``upstream`` method run on the pool; the
    pool's ``_pretrained_`` is the base and its other models are the experts,
    each calibrated on ``num_calibration_examples`` examples of its own task's
    train split. Returns the calibrated model (same class, keys and shapes as
    the merged one), or with ``return_upstream`` a dict that FusionBench
    evaluates as two models: ``{"upstream": ..., "featcal": ...}``.
    """

    def __init__(
        self,
        upstream: Optional[Any] = None,
        merged_model_path: Optional[str] = None,
        lambda_: float = 0.05,
        rho: float = 2.0,
        alpha: float = 0.3,
        eps: float = 1e-8,
        num_calibration_examples: int = 256,
        batch_size: int = 16,
        seed: int = 42,
        calibrate_bias: bool = True,
        calibrate_layernorm: bool = True,
        module_regex: Optional[str] = None,
        last_block_patch_token_weight: float = 1.0,
        accumulation_dtype: str = "float32",
        track_upstream_drift: bool = True,
        return_upstream: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # Validates every hyperparameter now, before any model or data is loaded.
        self.featcal_hparams = FeatCalHParams(
            lambda_=lambda_,
            rho=rho,
            alpha=alpha,
            eps=eps,
            num_calibration_examples=num_calibration_examples,
            batch_size=batch_size,
            seed=seed,
            calibrate_bias=calibrate_bias,
            calibrate_layernorm=calibrate_layernorm,
            module_regex=module_regex,
            last_block_patch_token_weight=last_block_patch_token_weight,
            accumulation_dtype=accumulation_dtype,
        )

    def run(self, modelpool: BaseModelPool):
        if not isinstance(modelpool, BaseModelPool):
            modelpool = BaseModelPool(modelpool)
        hp = self.featcal_hparams

        # Everything that can be wrong with the input is checked before the upstream merge runs.
        if not modelpool.has_pretrained:
            raise ValueError(
                "FeatCal needs the base model as `_pretrained_` in the model pool (it anchors every solve)"
            )
        tasks = list(modelpool.model_names)
        if not tasks:
            raise ValueError("the model pool has no expert models besides `_pretrained_`")
        check_upstream_source(modelpool, self.upstream, self.merged_model_path)
        check_train_splits(modelpool, tasks)
        with self.profile("load models"):
            base = modelpool.load_pretrained_model()
            adapter = adapter_class_for(base).from_hparams(hp)
            plan_blocks(adapter, base, hp)
            experts = {}
            for task in tasks:
                experts[task] = modelpool.load_model(task)
                check_same_architecture(base, experts[task], f"expert {task!r}")
        with self.profile("load calibration data"):
            datasets = select_calibration_data(modelpool, tasks, hp.num_calibration_examples, hp.seed)

        with self.profile("upstream merge"):
            merged, source = load_merged_model(modelpool, self.upstream, self.merged_model_path, self, base)
        check_same_architecture(base, merged, f"the merged model ({source})")
        if merged is base or any(merged is e for e in experts.values()):
            merged = copy.deepcopy(merged)  # never calibrate the base or an expert in place
        upstream_model = copy.deepcopy(merged) if self.return_upstream else None

        engine = FeatCalEngine(
            adapter,
            hp,
            self.fabric.device,
            track_upstream=self.track_upstream_drift,
            log_fn=self._log_metrics,
        )
        batches = {t: adapter.make_input_batches(modelpool, datasets[t], hp.batch_size) for t in tasks}
        with self.profile("calibration"):
            report = engine.run(merged, base, experts, batches)
        report.update(
            {
                "upstream": source,
                "hparams": {k: getattr(hp, k) for k in hp.__dataclass_fields__},
                "device": str(self.fabric.device),
            }
        )
        self._save_report(report)
        self.print_profile_summary("FeatCal profile")

        if self.return_upstream:
            return {"upstream": upstream_model, "featcal": merged, "featcal_calibration": _summary(report)}
        return merged

    def _log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        if self.fabric is not None and self.fabric.loggers:
            self.fabric.log_dict(metrics, step=step)

    def _save_report(self, report: Dict[str, Any]) -> None:
        log_dir = self.log_dir
        if log_dir is None or not self.fabric.is_global_zero:
            return
        path = os.path.join(log_dir, REPORT_NAME)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        log.info("FeatCal calibration report saved to %s", path)


def _summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """Calibration time and last-block drift, small enough for FusionBench's report."""
    last = report["blocks"][-1]["drift"]
    return {
        "seconds": report["seconds"],
        "upstream": report["upstream"],
        "last_block_drift": last,
    }


__all__ = ["FeatCalAlgorithm"]
