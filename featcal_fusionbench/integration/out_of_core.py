"""``method.out_of_core``: no model is ever whole in memory, the calibrated one included.

The merged model is a lazy model like the base and the experts (``models.lazy``): read from ``merged_model_path``
or the pool's ``_merged_`` (any merger's safetensors checkpoint, mergekit's included), or computed tensor by tensor
from the lazy base and experts when the upstream is FusionBench's Task Arithmetic or TIES (``models.lazy_merge``). Each
block is read when its turn comes, calibrated, written to the output checkpoint and released; the tensors outside
the blocks (embeddings, final norm, head), which FeatCal never changes, are copied through a module at a time. The
output is an HF folder (safetensors shards, their index, config, generation config, tokenizer) that
``from_pretrained`` loads, written in a temporary folder and renamed into place when complete
(``models.checkpoint_writer``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from omegaconf import DictConfig
from torch import nn

from ..models.checks import check_checkpoint_matches, warn_config_differences
from ..models.lazy import CheckpointTensors, checkpoint_folder, entry_path, lazy_like
from ..models.lazy_merge import lazy_task_arithmetic, lazy_ties_merging
from .upstream import check_upstream_source, describe_upstream

log = logging.getLogger(__name__)

#: the default output folder under the run's log folder when the program saves nothing
DEFAULT_OUTPUT = "featcal_model"

# FusionBench's per-element mergers that run tensor by tensor here (``fusion_bench/method/__init__.py`` exports them
# under these names), and whether the class merges only the decoder layers when ``merge_backbone`` is set
# (``fusion_bench/method/linear/task_arithmetic_for_causallm.py``, ``ties_merging_for_causallm.py``:
# ``model.model.layers`` from a CausalLMBackbonePool).
TASK_ARITHMETIC = {
    "TaskArithmeticAlgorithm": False,
    "TaskArithmeticForCausalLM": True,
    "TaskArithmeticForLlama": True,
}
TIES_MERGING = {
    "TiesMergingAlgorithm": False,
    "TiesMergingForCausalLM": True,
}


def lazy_upstream(upstream: Any) -> Optional[Dict[str, Any]]:
    """The upstream config's settings when it is one of FusionBench's Task Arithmetic or TIES classes (``kind``,
    ``scaling_factor``, ``backbone_only``; TIES' ``threshold`` and ``merge_func``), else None."""
    if not isinstance(upstream, (dict, DictConfig)):
        return None
    target = str(upstream.get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    backbone = {**TASK_ARITHMETIC, **TIES_MERGING}
    if not target.startswith("fusion_bench.") or name not in backbone:
        return None  # another class of that name may merge otherwise
    if upstream.get("model_save_path") is not None:
        raise ValueError(
            f"out_of_core computes the upstream {name} tensor by tensor and never holds the merged model whole, so "
            "it cannot save it: set upstream.model_save_path=null (the calibrated model is saved)")
    if not upstream.get("inplace", True):
        log.info("upstream.inplace=false changes nothing out of core: the base is never modified")
    settings = {"kind": "ties" if name in TIES_MERGING else "task_arithmetic",
                "scaling_factor": float(upstream["scaling_factor"]),
                "backbone_only": backbone[name] and bool(upstream.get("merge_backbone", False))}
    if settings["kind"] == "ties":
        if upstream.get("remove_keys"):
            raise ValueError(f"out_of_core merges every tensor of {name}; upstream.remove_keys "
                             f"{list(upstream['remove_keys'])} is not supported (set it to [])")
        settings.update(threshold=float(upstream["threshold"]), merge_func=str(upstream.get("merge_func", "sum")))
    return settings


def check_out_of_core(modelpool, upstream: Any, merged_model_path: Optional[str], selection=None) -> None:
    """Refuse, before any model is read, what out of core cannot do."""
    check_upstream_source(modelpool, upstream, merged_model_path)
    if merged_model_path is None and not modelpool.has_merged and lazy_upstream(upstream) is None:
        raise ValueError(
            f"out_of_core reads the merged model block by block: the upstream {describe_upstream(upstream)} would "
            "build it whole; give its saved checkpoint as method.merged_model_path (or the pool's `_merged_`), or use "
            "FusionBench's Task Arithmetic or TIES as the upstream (computed tensor by tensor)")
    if selection is not None and selection.criterion != "objective":
        raise ValueError(
            f"auto_select criterion {selection.criterion!r} calibrates a copy of the whole merged model per "
            "candidate; out of core, use criterion objective (chosen block by block in the one calibration pass)")
    if selection is not None and selection.alpha_criterion != "none":
        raise ValueError(
            f"auto_select alpha_criterion {selection.alpha_criterion!r} calibrates a copy of the whole merged model per "
            "alpha; out of core, set auto_select.alpha_criterion=none (alpha stays method.alpha) or fix method.alpha")


def load_lazy_merged(modelpool, upstream: Any, merged_model_path: Optional[str], base: nn.Module,
                     experts: Dict[str, nn.Module]) -> Tuple[nn.Module, str]:
    """The merged model as a lazy model, and where it came from (the sources' precedence is ``load_merged_model``'s)."""
    saved = None
    if merged_model_path is not None:
        saved, label, source = merged_model_path, "merged_model_path", f"path:{merged_model_path}"
    elif modelpool.has_merged:
        entry = modelpool.get_model_config("_merged_", return_copy=False)
        saved, label, source = entry_path(entry), "the pool's `_merged_`", "pool:_merged_"
        if saved is None:
            raise TypeError("out_of_core reads the pool's `_merged_` from its checkpoint; it is not a path or hub id")
    if saved is not None:
        folder = checkpoint_folder(saved)
        check_checkpoint_matches(folder, base, label)
        warn_config_differences(folder, base, label)
        return lazy_like(base, CheckpointTensors(folder)), source
    return lazy_merge_of(base, experts, lazy_upstream(upstream)), f"method:{describe_upstream(upstream)} (out of core)"


def lazy_merge_of(base: nn.Module, experts: Dict[str, nn.Module], settings: Dict[str, Any]) -> nn.Module:
    """The merge ``lazy_upstream``'s ``settings`` describe, of the lazy base and experts, computed tensor by tensor."""
    layers = f"{layers_prefix(base)}." if settings["backbone_only"] else ""

    def merged(key: str) -> bool:
        return key.startswith(layers)

    if settings["kind"] == "ties":
        return lazy_ties_merging(base, experts, settings["scaling_factor"], settings["threshold"],
                                 settings["merge_func"], merged)
    return lazy_task_arithmetic(base, experts, settings["scaling_factor"], merged)


def layers_prefix(model: nn.Module) -> str:
    """The name of the decoder layers FusionBench's ``merge_backbone`` merges (``model.model.layers``)."""
    layers = model.model.layers
    return next(name for name, module in model.named_modules() if module is layers)


#: allocations at least this large get their own memory map, returned to the system when freed
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def map_large_allocations(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have glibc's malloc give every allocation of at least ``threshold`` bytes a memory map of its own. By default
    glibc raises that threshold to 32 MiB as large blocks are freed, so a block's many tensors of 1-32 MiB (hidden
    states, activations, small weights) come from the heap, whose freed holes stay resident: 0.6 GiB of the 6.40 GiB
    peak at the Llama-3.2-3B shape (experiments/docs/benchmarks.md). False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    if done:
        log.info("out_of_core: allocations of %d bytes or more are memory-mapped (returned when freed)", threshold)
    return done


def output_path(save_path: Optional[str], log_dir: Optional[str]) -> str:
    """Where the calibrated model goes: the program's ``merged_model_save_path`` (``{log_dir}`` filled in), else
    ``<log_dir>/featcal_model``."""
    if save_path:
        return save_path.format(log_dir=log_dir) if "{log_dir}" in save_path and log_dir else save_path
    if log_dir:
        return os.path.join(log_dir, DEFAULT_OUTPUT)
    raise ValueError("out_of_core writes the calibrated model to disk: set merged_model_save_path (or path.log_dir)")


def save_config_and_tokenizer(model: nn.Module, modelpool):
    """``CheckpointWriter.commit``'s extra files: the model's config and generation config, the pool's tokenizer."""

    def save(folder) -> None:
        model.config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
        if getattr(modelpool, "load_tokenizer", None) is not None and getattr(modelpool, "tokenizer", None) is not None:
            modelpool.load_tokenizer().save_pretrained(folder)

    return save


def upstream_path(output) -> str:
    """Where ``return_upstream`` writes the upstream model out of core: beside the calibrated one."""
    return f"{str(output).rstrip('/')}_upstream"


class OneAtATime(dict):
    """Written models for FusionBench's program, which evaluates a returned dict's models in turn
    (``FabricModelFusionProgram.evaluate_merged_model``: ``for key, item in merged_model.items()``): each is loaded
    when its turn comes, and its tensors are released before the next is loaded, so that no two are in memory at
    once. Other entries are the report's metadata."""

    def __init__(self, loaders: Mapping[str, Callable[[], nn.Module]], metadata: Mapping[str, Any]):
        super().__init__({**dict.fromkeys(loaders, None), **metadata})
        self.loaders = dict(loaders)

    def items(self):
        for key in list(self.keys()):
            if key not in self.loaders:
                yield key, dict.__getitem__(self, key)
                continue
            model = self.loaders[key]()
            yield key, model
            model.to("meta")  # the task pool has scored it: its tensors go, whoever still holds the module
            del model


__all__ = ["DEFAULT_OUTPUT", "OneAtATime", "check_out_of_core", "lazy_merge_of", "lazy_upstream", "load_lazy_merged",
           "map_large_allocations", "output_path", "save_config_and_tokenizer", "upstream_path"]
