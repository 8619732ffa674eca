"""A text-generation task pool for seq2seq models (FLAN-T5 GLUE, the offline text world) with an ``average``.

Scores as FusionBench's ``flan-t5_glue_text_generation`` pool does, with FusionBench's own functions:
``generate(max_length=10)`` and exact match of the decoded text, or Spearman's rho of ``float()``-parsed
outputs for regression tasks (STS-B). Three things are added: any task list and dataset (loaded from a
config, e.g. ``featcal_fusionbench.integration.glue.load_glue_dataset`` or ``datasets.load_from_disk``), the ``average`` of the
per-task scores, and the task switch that per-task post-merging wrappers (Surgery, ProbSurgery) need:
a model with ``is_surgery_model`` gets ``active_task`` set before each task is evaluated.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Sequence

from fusion_bench.mixins import LightningFabricMixin
from fusion_bench.taskpool import BaseTaskPool
from fusion_bench.tasks.flan_t5_text_generation.glue_evaluation import evaluate_accuracy, evaluate_spearman_rho
from fusion_bench.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, default_data_collator

from ..models.task_switch import active_task

log = logging.getLogger(__name__)

ACCURACY = "accuracy"
SPEARMAN = "spearman_rho"


def load_tokenizer(tokenizer: Any):
    """A tokenizer from a path / hub name, a ``_target_`` config, or a tokenizer object."""
    if isinstance(tokenizer, str):
        return AutoTokenizer.from_pretrained(tokenizer)
    if isinstance(tokenizer, (dict, DictConfig)):
        return instantiate(tokenizer)
    return tokenizer


def average_report(scores: Dict[str, float]) -> Dict[str, Any]:
    """The mean of the per-task scores. Spearman's rho is undefined (NaN) when a model's outputs, or their parsed
    values, are all equal (e.g. STS-B scored on a model that writes one word); the average is then undefined too, and
    the report says which task made it so and gives the mean over the others, rather than an average of NaN."""
    undefined = sorted(t for t, v in scores.items() if math.isnan(v))
    if not undefined:
        return {"score": sum(scores.values()) / len(scores)}
    defined = [v for t, v in scores.items() if t not in undefined]
    note = (f"undefined: {', '.join(undefined)} scored NaN (Spearman's rho of constant outputs is undefined); "
            f"score_of_defined is the mean over the other {len(defined)} task(s)")
    log.warning("average %s", note)
    return {"score": None, "score_of_defined": sum(defined) / len(defined) if defined else None, "note": note}


class TextGenerationTaskPool(LightningFabricMixin, BaseTaskPool):
    """Exact-match accuracy per task (Spearman's rho for ``regression_tasks``) and their ``average``.

    Args:
        test_datasets: task name -> dataset config (or dataset) with ``input_ids``, ``attention_mask`` and
            ``labels`` (padded with -100), as FusionBench's FLAN-T5 GLUE cache holds them.
        tokenizer: path, hub name or ``_target_`` config of the tokenizer that decodes outputs and labels.
        regression_tasks: tasks scored by Spearman's rho on ``float()``-parsed outputs.
        max_length: generation length, 10 as in FusionBench.
    """

    _config_mapping = BaseTaskPool._config_mapping | {
        "_test_datasets": "test_datasets",
        "_tokenizer": "tokenizer",
        "_regression_tasks": "regression_tasks",
        "max_length": "max_length",
        "batch_size": "batch_size",
        "num_workers": "num_workers",
    }

    def __init__(
        self,
        test_datasets,
        *,
        tokenizer,
        regression_tasks: Optional[Sequence[str]] = None,
        max_length: int = 10,
        batch_size: int = 32,
        num_workers: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not test_datasets:
            raise ValueError("the text-generation task pool has no test_datasets")
        self._test_datasets = test_datasets
        self._tokenizer = tokenizer
        self._regression_tasks = list(regression_tasks or [])
        unknown = [t for t in self._regression_tasks if t not in test_datasets]
        if unknown:
            raise ValueError(f"regression_tasks {unknown} are not among the test datasets {list(test_datasets)}")
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        self.max_length = max_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._tokenizer_instance = None

    @property
    def task_names(self):
        return list(self._test_datasets)

    @property
    def tokenizer(self):
        if self._tokenizer_instance is None:
            self._tokenizer_instance = load_tokenizer(self._tokenizer)
        return self._tokenizer_instance

    def metric(self, task: str) -> str:
        return SPEARMAN if task in self._regression_tasks else ACCURACY

    def load_test_dataset(self, task: str):
        config = self._test_datasets[task]
        return instantiate(config) if isinstance(config, (dict, DictConfig)) else config

    def _score(self, device_model, task: str) -> Dict[str, float]:
        loader = DataLoader(
            self.load_test_dataset(task),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            shuffle=False,
            collate_fn=default_data_collator,
        )
        loader = self.fabric.setup_dataloaders(loader)
        score_fn = evaluate_spearman_rho if self.metric(task) == SPEARMAN else evaluate_accuracy
        score = float(score_fn(device_model, loader, self.tokenizer))
        return {self.metric(task): score}

    def evaluate(self, model, name: Optional[str] = None) -> Dict[str, Any]:
        model = model.eval()
        device_model = self.fabric.setup(model)
        report: Dict[str, Any] = {}
        for task in self.task_names:
            # The wrapper object the task switch needs is the unwrapped model; generate runs on the device.
            with active_task(model, task):
                report[task] = self._score(device_model, task)
            log.info("task %s: %s", task, report[task])
        report["average"] = average_report({t: report[t][self.metric(t)] for t in self.task_names})
        if name is not None:
            report["model_info"] = {"name": name}
        return report


__all__ = ["TextGenerationTaskPool", "active_task", "average_report", "load_tokenizer"]
