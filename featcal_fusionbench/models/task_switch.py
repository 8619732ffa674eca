"""The task switch: which task's per-task map a merged model applies while a task pool evaluates that task.

Task pools that do not name the task to the model (the lm-eval and OpenCLIP pools, the text pools) set
``active_task`` while they evaluate a task; ``LMHeadSurgery`` applies that task's map (a Surgery or ProbSurgery
wrapper's) on a language model's ``lm_head`` input, ``EncoderOutputSurgery`` on an image encoder's output."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from torch import Tensor, nn


@contextmanager
def active_task(model, task: str):
    """Tell a per-task wrapper which task's map to apply while ``task`` is evaluated."""
    if not getattr(model, "is_surgery_model", False):
        yield
        return
    previous = getattr(model, "active_task", None)
    model.active_task = task
    try:
        yield
    finally:
        model.active_task = previous


class ActiveTaskSurgery(nn.Module):
    """The merged model with the maps of ``active_task`` applied where a subclass puts them; with no active task
    the merged model runs unchanged. ``active_task`` is set by the task pool (``active_task``)."""

    is_surgery_model = True

    def __init__(self, maps: nn.Module):
        super().__init__()
        self.maps = maps  # Surgery or ProbSurgery wrapper around the merged model
        self.active_task: Optional[str] = None

    @property
    def model(self) -> nn.Module:
        return self.maps.model

    @property
    def task_names(self):
        return list(self.maps.test_datasets)

    def mapped(self, features: Tensor) -> Tensor:
        """``features`` through the active task's map, in their own dtype."""
        return self.maps.compute_surgery_features(features, self.active_task)[0].to(features.dtype)

    def collect_trainable_params(self):
        return self.maps.collect_trainable_params()

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class LMHeadSurgery(ActiveTaskSurgery):
    """A language model whose ``lm_head`` input passes through the active task's map."""

    def __init__(self, maps: nn.Module):
        super().__init__(maps)
        self.model.lm_head.register_forward_pre_hook(self._map_features)

    def _map_features(self, _module, args):
        if self.active_task is None:
            return None
        (hidden,) = args
        return (self.mapped(hidden),)

    def generate(self, *args, **kwargs):
        return self.model.generate(*args, **kwargs)


def unit(features: Tensor) -> Tensor:
    """Features scaled to unit L2 norm, as FusionBench's HF CLIP classifier normalises its image embeddings."""
    return features / features.norm(p=2, dim=-1, keepdim=True)


class EncoderOutputSurgery(ActiveTaskSurgery):
    """An image encoder whose output passes through the active task's map, as Surgery's original code deploys
    its maps on the task-vector encoders (the task's classification head reads the mapped feature). With
    ``normalize`` the map reads the unit-normalised output instead (FusionBench's HF CLIP protocol)."""

    def __init__(self, maps: nn.Module, normalize: bool = False):
        super().__init__(maps)
        self.normalize = normalize

    def forward(self, *args, **kwargs):
        features = self.model(*args, **kwargs)
        if self.normalize:
            features = unit(features)
        return features if self.active_task is None else self.mapped(features)

    # FusionBench's ImageClassifier reads its encoder's transforms.
    @property
    def train_preprocess(self):
        return self.model.train_preprocess

    @property
    def val_preprocess(self):
        return self.model.val_preprocess

