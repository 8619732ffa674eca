"""Registry of architecture adapters; the first that supports a model wins."""

from __future__ import annotations

from typing import List, Type

from torch import nn

from .base import LAYERNORM, LINEAR, RMSNORM, UNIFORM, ArchitectureAdapter
from .clip_vision import CLIPVisionAdapter
from .t5 import T5Adapter

ADAPTERS: List[Type[ArchitectureAdapter]] = [CLIPVisionAdapter, T5Adapter]


def register_adapter(adapter_cls: Type[ArchitectureAdapter]) -> Type[ArchitectureAdapter]:
    ADAPTERS.append(adapter_cls)
    return adapter_cls


def adapter_class_for(model: nn.Module) -> Type[ArchitectureAdapter]:
    for adapter_cls in ADAPTERS:
        if adapter_cls.supports(model):
            return adapter_cls
    known = ", ".join(a.__name__ for a in ADAPTERS)
    raise TypeError(
        f"FeatCal has no architecture adapter for {type(model).__name__}; known adapters: {known}"
    )


__all__ = [
    "ADAPTERS",
    "ArchitectureAdapter",
    "CLIPVisionAdapter",
    "LAYERNORM",
    "LINEAR",
    "RMSNORM",
    "T5Adapter",
    "UNIFORM",
    "adapter_class_for",
    "register_adapter",
]
