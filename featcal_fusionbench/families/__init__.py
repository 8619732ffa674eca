"""The model-family registry: one module per family, registered by ``@register_family``.

Families are imported on the first lookup, not when the package is imported, so that
``import featcal_fusionbench`` loads no model code it does not need: every module of this package
(but ``base`` and ``sites``), then every module that another distribution names under the entry-point
group ``featcal_fusionbench.families``. Adding a family is adding its module; no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points
from typing import Any, Dict, List, Mapping, Optional, Type

from torch import nn

from .base import UNIFORM, FeatureSite, ModelFamily, batch_loader, to_device
from .sites import LAYERNORM, LINEAR, NORM_KINDS, RMSNORM, LayerNormSite, LinearSite, RMSNormSite, RowsSite, Site

ENTRY_POINT_GROUP = "featcal_fusionbench.families"
_NOT_FAMILIES = {"base", "sites"}

_FAMILIES: Dict[str, Type[ModelFamily]] = {}
_imported = False


def _import_families() -> None:
    global _imported
    if _imported:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _NOT_FAMILIES:
            importlib.import_module(f"{__name__}.{info.name}")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        importlib.import_module(entry.value)
    _imported = True


def register_family(cls: Type[ModelFamily]) -> Type[ModelFamily]:
    """Class decorator: make ``cls`` a family that models are matched against (by ``cls.supports``)."""
    if cls.name in _FAMILIES and _FAMILIES[cls.name] is not cls:
        raise ValueError(f"a model family named {cls.name!r} is already registered ({_FAMILIES[cls.name].__module__})")
    _FAMILIES[cls.name] = cls
    return cls


def families() -> List[Type[ModelFamily]]:
    """Every registered family class (the first call imports them)."""
    _import_families()
    return list(_FAMILIES.values())


def family_class_for(model: nn.Module) -> Type[ModelFamily]:
    matching = [cls for cls in families() if cls.supports(model)]
    if not matching:
        known = ", ".join(cls.name for cls in families())
        raise TypeError(f"FeatCal has no model family for {type(model).__name__}; registered families: {known}")
    if len(matching) > 1:
        raise TypeError(
            f"{type(model).__name__} matches several model families: {', '.join(c.name for c in matching)}"
        )
    return matching[0]


def family_for(model: nn.Module, options: Optional[Mapping[str, Any]] = None) -> ModelFamily:
    """The family instance for ``model`` with ``options`` (``method.family_options``) validated."""
    return family_class_for(model)(**dict(options or {}))


def checked_options(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """A method's ``family_options`` as a plain dict; fails early (before any model is loaded) on something that is
    not a mapping or on an option that no registered family knows."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"family_options must map option names to values, got {options!r}")
    known = {name for cls in families() for name in cls.options}
    unknown = sorted(set(options or {}) - known)
    if unknown:
        raise ValueError(
            f"family_options {unknown} is not an option of any model family; known: {', '.join(sorted(known)) or 'none'}"
        )
    return dict(options or {})


__all__ = [
    "FeatureSite",
    "LAYERNORM",
    "LINEAR",
    "LayerNormSite",
    "LinearSite",
    "ModelFamily",
    "NORM_KINDS",
    "RMSNORM",
    "RMSNormSite",
    "RowsSite",
    "Site",
    "UNIFORM",
    "batch_loader",
    "checked_options",
    "families",
    "family_class_for",
    "family_for",
    "register_family",
    "to_device",
]
