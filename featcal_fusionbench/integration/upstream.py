"""Getting the upstream merged model that a post-merging method starts from.

Three sources, in this order of precedence: a saved model path, a ``_merged_``
entry in the pool, or a nested FusionBench method config that is run on the
pool (FusionBench's own "base method, then calibrate" pattern).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from ..models.checks import (check_checkpoint_matches, check_pool_checkpoint, checkpoint_architectures,
                             warn_config_differences)

log = logging.getLogger(__name__)


def instantiate_upstream(upstream: Any, parent: Any):
    """Build the upstream method and hand it the parent's Fabric and program."""
    from fusion_bench.utils.instantiate_utils import instantiate

    if isinstance(upstream, (dict, DictConfig)):
        if "_target_" not in upstream:
            raise ValueError(f"the upstream method config has no `_target_`: {dict(upstream)}")
        method = instantiate(upstream, _recursive_=False)
    else:
        method = upstream
    if not callable(getattr(method, "run", None)):
        raise TypeError(f"the upstream method {type(method).__name__} has no run(modelpool)")
    for attr in ("_fabric_instance", "_program"):
        if hasattr(method, attr) and getattr(parent, attr, None) is not None:
            setattr(method, attr, getattr(parent, attr))
    return method


def describe_upstream(upstream: Any) -> str:
    if isinstance(upstream, (dict, DictConfig)):
        return str(upstream.get("_target_"))
    return type(upstream).__name__


def check_upstream_source(modelpool, upstream: Any, merged_model_path: Optional[str]) -> None:
    """Fail before any heavy work when no source of the merged model is given."""
    if merged_model_path is None and not modelpool.has_merged and upstream is None:
        raise ValueError(
            "no upstream merged model: set `upstream` to a FusionBench method config, "
            "add `_merged_` to the model pool, or set `merged_model_path`"
        )


def load_saved_model(path: str, reference: nn.Module, device_map: Any = None) -> nn.Module:
    """A merged model saved by FusionBench's ``merged_model_save_path`` or by another merger (mergekit): a
    ``save_pretrained`` folder (HF models; a local safetensors one is checked against ``reference``'s tensor names and
    shapes before any tensor is read), or the state dict file that ``BaseModelPool.save_model`` writes for other
    models (OpenCLIP's ``ImageEncoder``), loaded into a copy of ``reference`` (the base: same class and keys).
    ``device_map``: ``from_pretrained``'s, for a model larger than one device."""
    loader = getattr(type(reference), "from_pretrained", None)
    if loader is not None:
        check_checkpoint_matches(path, reference, "merged_model_path")
        kwargs = {}
        if type(reference).__name__ in checkpoint_architectures(path):
            # the base's architecture settings: a config.json written by transformers 5 (mergekit 0.1.5) keeps
            # rope_theta in rope_parameters, which 4.x ignores, falling back to 10000 without a word
            warn_config_differences(path, reference, "merged_model_path")
            kwargs["config"] = copy.deepcopy(reference.config)
        # In the base's dtype: from_pretrained's default is float32, which would double a bf16 LLM.
        dtype = getattr(reference, "dtype", None)
        if isinstance(dtype, torch.dtype):
            kwargs["torch_dtype"] = dtype
        if device_map is not None:
            kwargs["device_map"] = device_map
        return loader(path, **kwargs)
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"merged_model_path {path!r}: a {type(reference).__name__} has no from_pretrained, so a saved one is the "
            f"state dict file FusionBench's model pool writes (torch.save), and there is no such file")
    merged = copy.deepcopy(reference)
    merged.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return merged


def load_merged_model(
    modelpool, upstream: Any, merged_model_path: Optional[str], parent: Any, reference: nn.Module
) -> Tuple[nn.Module, str]:
    """Return (merged model, a description of where it came from)."""
    check_upstream_source(modelpool, upstream, merged_model_path)
    if merged_model_path is not None:
        if upstream is not None or modelpool.has_merged:
            log.warning("merged_model_path is set: the upstream method and any `_merged_` entry are not used")
        return load_saved_model(merged_model_path, reference), f"path:{merged_model_path}"
    if modelpool.has_merged:
        if upstream is not None:
            log.warning("the pool has `_merged_`: the upstream method config is not run")
        check_pool_checkpoint(modelpool, "_merged_", reference, "the pool's `_merged_`")
        return modelpool.load_model("_merged_"), "pool:_merged_"
    method = instantiate_upstream(upstream, parent)
    log.info("running the upstream merger %s", describe_upstream(upstream))
    merged = method.run(modelpool)
    if isinstance(merged, dict):
        raise TypeError(
            f"the upstream method {describe_upstream(upstream)} returned a dict; FeatCal needs one merged model"
        )
    return merged, f"method:{describe_upstream(upstream)}"
