"""What every post-merging method here shares: pool checks, the upstream merged model, reports.

FeatCal, Surgery and ProbSurgery all start from the same three sources of the merged
model and the same per-task calibration budget, and all fail before the upstream merge
runs when the input is bad.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from ..families import family_class_for
from ..models.checks import check_checkpoint_files, check_pool_checkpoint, check_same_architecture
from ..models.lazy import entry_path, load_pool_model_lazily
from .data import check_splits
from .hub_access import check_hub_access, fetch_only_loaded_files, hub_id, pool_sources
from .memory import peak_rss_bytes
from .pool_names import warn_if_nothing_is_evaluated
from .upstream import check_upstream_merger, check_upstream_source, load_merged_model

log = logging.getLogger(__name__)


class PostMergingMixin:
    """Needs ``upstream`` and ``merged_model_path`` attributes (``calibration_datasets`` optional), and
    LightningFabricMixin's ``fabric``."""

    method_name = "post-merging"

    def check_pool(self, modelpool, split: str = "train") -> List[str]:
        """Return the task names; raise on anything that would fail later."""
        warn_if_nothing_is_evaluated()
        if not modelpool.has_pretrained:
            raise ValueError(
                f"{self.method_name} needs the base model as `_pretrained_` in the model pool"
            )
        tasks = list(modelpool.model_names)
        if not tasks:
            raise ValueError("the model pool has no expert models besides `_pretrained_`")
        check_upstream_source(modelpool, self.upstream, self.merged_model_path)
        if self.merged_model_path is None and not modelpool.has_merged:  # the upstream will run
            check_upstream_merger(self.upstream, self.method_name)
        calibration = getattr(self, "calibration_datasets", None)
        merged_id = hub_id(self.merged_model_path)
        merged = [("method.merged_model_path", merged_id, "model")] if merged_id else []
        check_hub_access(itertools.chain(merged, pool_sources(modelpool, calibration, tasks)))
        check_splits(modelpool, tasks, split, calibration)
        # local checkpoints cut short or damaged are named now, from their headers, before any model loads
        check_checkpoint_files(self.merged_model_path)
        for name in modelpool.all_model_names:
            check_checkpoint_files(entry_path(modelpool.get_model_config(name, return_copy=False)))
        fetch_only_loaded_files(modelpool)  # the checks passed: what the pool would snapshot, fetched lean
        return tasks

    def load_base_and_experts(self, modelpool, tasks, lazy: bool = False) -> Tuple[nn.Module, Dict[str, nn.Module]]:
        """``lazy``: skeletons that read each block from the checkpoint when it is used (``models.lazy``)."""
        base = load_pool_model_lazily(modelpool, "_pretrained_") if lazy else modelpool.load_pretrained_model()
        return base, self.load_experts(modelpool, tasks, base, lazy)

    def load_experts(self, modelpool, tasks, base, lazy: bool = False) -> Dict[str, nn.Module]:
        tolerated = family_class_for(base).shapes_may_differ(base)
        experts = {}
        for task in tasks:
            # from the checkpoint's headers first: from_pretrained would fill a missing tensor at random
            check_pool_checkpoint(modelpool, task, base, f"expert {task!r}", tolerated)
            experts[task] = load_pool_model_lazily(modelpool, task) if lazy else modelpool.load_model(task)
            check_same_architecture(base, experts[task], f"expert {task!r}", tolerated)
        return experts

    def load_merged(self, modelpool, base, experts) -> Tuple[nn.Module, str]:
        merged, source = load_merged_model(modelpool, self.upstream, self.merged_model_path, self, base)
        check_same_architecture(base, merged, f"the merged model ({source})")
        if merged is base or any(merged is e for e in experts.values()):
            merged = copy.deepcopy(merged)  # never modify the base or an expert in place
        return merged, source

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        if self.fabric is not None and self.fabric.loggers:
            self.fabric.log_dict(metrics, step=step)

    def save_report(self, name: str, report: Dict[str, Any]) -> None:
        log_dir = self.log_dir
        if log_dir is None or not self.fabric.is_global_zero:
            return
        path = os.path.join(log_dir, name)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        log.info("%s report saved to %s", self.method_name, path)


def peak_memory(device) -> Dict[str, Any]:
    """Peak host RSS of this process so far (models, data and the calibration stage; evaluation comes later) and,
    on CUDA, peak allocated device memory."""
    device = torch.device(device)
    return {
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
