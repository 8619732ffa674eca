"""Per-task feature maps on a merged model's features, and how they are deployed.

Both wrappers follow FusionBench's surgery protocol: ``is_surgery_model = True`` and
``compute_surgery_features(features, dataset_name)``, so FusionBench's CLIP task pool
applies them inside its classifier. Surgery is FusionBench's own ``SurgeryModelWrapper``.
Task pools that do not name the task to the model deploy them through the task switch
(``models.task_switch``), which the model families and the task pools share.
"""

from __future__ import annotations

from typing import Callable, List, Union

import torch
import torch.nn.functional as F
from fusion_bench.models.surgery.surgerymodelwrapper import SurgeryModelWrapper, regularize_name
from torch import Tensor, nn

__all__ = [
    "ProbSurgeryModelWrapper",
    "SurgeryModelWrapper",
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


