"""Per-task feature maps on a merged model's features, and how they are deployed.

Both wrappers follow FusionBench's surgery protocol: ``is_surgery_model = True`` and
``compute_surgery_features(features, dataset_name)``, so FusionBench's CLIP task pool
applies them inside its classifier. Surgery is FusionBench's own ``SurgeryModelWrapper``.
Task pools that do not name the task to the model deploy them through ``ActiveTaskSurgery``:
the task pool sets ``active_task`` (the context manager here) while it evaluates a task, and
``LMHeadSurgery`` applies that task's map on a language model's ``lm_head`` input,
``EncoderOutputSurgery`` on an image encoder's output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from fusion_bench.models.surgery.surgerymodelwrapper import SurgeryModelWrapper, regularize_name
from torch import Tensor, nn

__all__ = [
    "ActiveTaskSurgery",
    "EncoderOutputSurgery",
    "LMHeadSurgery",
    "ProbSurgeryModelWrapper",
    "SurgeryModelWrapper",
    "active_task",
    "kl_to_standard_normal",
]


class _ProbHead(nn.Module):
    """h = ReLU(up(f)); mu = mean(h); logvar = logvar(h). Bias-free, as Surgery's maps are."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)  # PyTorch's default init: Kaiming uniform, a = sqrt(5)
        self.mean = nn.Linear(hidden, dim, bias=False)
        self.logvar = nn.Linear(hidden, dim, bias=False)
        nn.init.zeros_(self.mean.weight)
        nn.init.zeros_(self.logvar.weight)

    def forward(self, features: Tensor):
        h = F.relu(self.up(features))
        return self.mean(h), self.logvar(h)


def kl_to_standard_normal(mu: Tensor, logvar: Tensor) -> Tensor:
    """Batch mean of KL(N(mu, exp(logvar)) || N(0, I)) summed over feature dimensions."""
    return (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(dim=-1)).mean()


class ProbSurgeryModelWrapper(nn.Module):
    """ProbSurgery (Wei et al., ICML 2025): f' = f - z, z ~ N(mu(f), exp(logvar(f))) per task.

    In training mode z is sampled; in eval mode (as FusionBench's classifier runs it)
    z = mu, so evaluation is deterministic.
    """

    is_surgery_model = True

    def __init__(self, model: nn.Module, test_datasets: List[str], projection_dim: int, hidden_dim: int = 128):
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.test_datasets = list(test_datasets)
        self.heads = nn.ModuleDict({regularize_name(t): _ProbHead(projection_dim, hidden_dim) for t in test_datasets})

    def sample(self, features: Tensor, dataset_name: str):
        """(f - z, mu, logvar): z is sampled in training mode and is mu in eval mode."""
        features = features.detach()
        mu, logvar = self.heads[regularize_name(dataset_name)](features)
        shift = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu) if self.training else mu
        return features - shift, mu, logvar

    def compute_surgery_features(
        self, compute_features_fn: Union[Tensor, Callable[[nn.Module], Tensor]], dataset_name: str
    ):
        features = compute_features_fn if isinstance(compute_features_fn, Tensor) else compute_features_fn(self.model)
        mapped, _, _ = self.sample(features, dataset_name)
        return mapped, features.detach(), features.detach() - mapped

    def collect_trainable_params(self):
        return list(self.heads.parameters())

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


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
