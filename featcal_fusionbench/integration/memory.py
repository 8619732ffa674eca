"""``method.models_in_memory``: which models a run holds whole, and the choice made for ``auto``; and a process's
peak resident memory, as the reports give it.

- ``all``: the base, the experts and the merged model whole in memory (FusionBench's own way);
- ``merged``: only the merged (then calibrated) model whole; the base and the experts are read a block at a time
  from their safetensors checkpoints;
- ``none``: no model whole: the merged model is read (or computed) a block at a time too, and the calibrated one is
  written a block at a time (out of core; resumable);
- ``auto`` (the default): ``all`` when the checkpoints' sizes fit in half of the host's available memory, else
  ``merged`` when one model fits in a quarter of it, else ``none`` where the merged model can be read block by
  block (else ``merged``, with a warning). Where the
  sizes cannot be read (a live module in the pool, a hub id not downloaded yet, no safetensors), ``all``. The
  choice and why are logged.

The former flags ``lazy_loading`` (= ``merged``) and ``out_of_core`` (= ``none``) still work, with a warning.
"""

from __future__ import annotations

import logging
import resource
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

CHOICES = ("auto", "all", "merged", "none")
#: the share of the host's available memory that ``auto`` lets whole models take (the rest: activations, moments)
AUTO_SHARE = 0.5


def resolve_setting(models_in_memory: str, lazy_loading: Optional[bool], out_of_core: Optional[bool]) -> str:
    """The setting, with the deprecated flags folded in (a contradiction is refused)."""
    if models_in_memory not in CHOICES:
        raise ValueError(f"method.models_in_memory must be one of {list(CHOICES)}, got {models_in_memory!r}")
    if lazy_loading is None and out_of_core is None:
        return models_in_memory
    implied = "none" if out_of_core else "merged" if lazy_loading else "all"
    old = ", ".join(f"method.{k}={v}" for k, v in (("lazy_loading", lazy_loading), ("out_of_core", out_of_core))
                    if v is not None)
    warnings.warn(f"{old} is deprecated: use method.models_in_memory={implied}", FutureWarning, stacklevel=4)
    if models_in_memory not in ("auto", implied):
        raise ValueError(f"{old} (models_in_memory={implied}) contradicts method.models_in_memory={models_in_memory}; "
                         "set only models_in_memory")
    return implied


def checkpoint_bytes(path: Optional[str]) -> Optional[int]:
    """The size of a safetensors checkpoint on this machine (a folder, or a hub id already in the cache), else
    None."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(path), allow_patterns=["*.safetensors"], local_files_only=True))
        except Exception:  # not a hub id, or not downloaded yet: its size is unknown here
            return None
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def choose(modelpool, tasks: Sequence[str], merged_streams: Callable[[], bool]) -> Tuple[str, str]:
    """``auto``'s choice and why. ``merged_streams()``: whether the merged model can be read block by block (a
    saved merge, or an upstream computed per tensor)."""
    from ..models.lazy import entry_path

    entry = modelpool.get_model_config("_pretrained_", return_copy=False)
    size = checkpoint_bytes(entry_path(entry))
    if size is None:
        return "all", "the base model's safetensors size is not known here"
    available = available_bytes()
    budget = AUTO_SHARE * available
    whole = (len(tasks) + 2) * size
    gib = 2**30
    sizes = f"{len(tasks) + 2} models of {size / gib:.2f} GiB, {available / gib:.1f} GiB available"
    if whole <= budget:
        return "all", f"{sizes}: all fit in half of it"
    if size <= budget / 2:
        return "merged", f"{sizes}: one model fits in a quarter of it"
    if merged_streams():
        return "none", f"{sizes}: not even one model fits in a quarter of it"
    return "merged", (f"{sizes}: one model hardly fits, but the merged one cannot be read block by block (save the "
                      "merge and give it as method.merged_model_path to run out of core)")


def peak_rss_bytes() -> int:
    """This process's own peak resident memory: the kernel's high-water mark of its address space (Linux VmHWM).
    ``ru_maxrss`` is not that: Linux carries a parent's peak into a child across fork and exec, so a process started
    by one that once held 11 GiB reports at least 11 GiB. Elsewhere, ``ru_maxrss``. Here, apart from FusionBench and
    torch, so that a benchmark's parent process reads it without importing them."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


__all__ = ["AUTO_SHARE", "CHOICES", "available_bytes", "checkpoint_bytes", "choose", "peak_rss_bytes", "resolve_setting"]
