"""Hidden-state streams under a device-memory budget.

FeatCal holds, for every task, each calibration batch's hidden states of the calibrated model and of the task's
expert (and, on request, of the upstream model) from one block to the next: at LLM scale that is
n x seq_len x width x 2 bytes per stream, two or three streams per task, often more than the device has beside
the model. A ``StreamStore`` shared by all of a run's streams decides where each batch lives. A batch stays on the
compute device while the resident bytes fit the budget. Beyond it, it is spilled to host memory (pinned when the
device is CUDA, so that copies back are DMA transfers) or to files in a temporary folder. When its turn comes it is
fetched to the device, and the engine puts its new state back after. Tensors keep their dtype, values, shapes and
strides (bit-exact round trips); moments are not streams and stay with the engine in float32/float64.

A batch's metadata (masks, rotary tables, T5's encoder output) follows the same path as its hidden states, in its
own parcel. It is not small: T5's decoder state carries the encoder output (as large as the hidden states) and
attention biases of B x heads x L x L, and a padded Llama batch a B x 1 x L x L mask. It is written once
(embedding, or T5's encoder-to-decoder step) and only read after.

Spilled tensors are moved buffer by buffer, not tensor by tensor: an expanded mask (one row broadcast to L rows)
keeps its layout and costs only the bytes it owns, and one tensor held under two names is stored once. A tensor
viewing a slice of a larger buffer is cloned first, so that the rest of that buffer is not spilled with it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
import shutil
import tempfile
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

SPILL_TARGETS = ("host", "disk")
AUTO = "auto"
# Of the device memory left free beside the model, a block and its statistics, the share streams may take: the
# rest is headroom for activations (the MLP's intermediate states, attention) and allocator fragmentation.
AUTO_FREE_FRACTION = 0.5

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: Union[int, str]) -> int:
    """A byte count: an integer, or a string with a decimal or binary unit ("8GB", "512MiB")."""
    if isinstance(value, float) and value.is_integer():  # YAML reads 8e9 as a float
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a byte count (an integer >= 0, or e.g. '8GB', '512MiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class StreamOptions:
    """Where FeatCal keeps its hidden-state streams; checked at construction, before any model is loaded.

    ``device_bytes``: the budget of stream bytes resident on the compute device (an integer or "8GB"); None or
    "auto" derives it from the device (see :func:`auto_device_budget`). ``spill``: "host" or "disk", where batches
    beyond the budget go. ``spill_dir``: the folder in which the disk spill's temporary folder is made (None: the
    system's temporary folder).
    """

    device_bytes: Union[None, int, str] = None
    spill: str = "host"
    spill_dir: Optional[str] = None

    def __post_init__(self):
        problems = []
        if self.device_bytes is not None and self.device_bytes != AUTO:
            try:
                parse_bytes(self.device_bytes)
            except ValueError as err:
                problems.append(f"stream_device_bytes: {err} or null / {AUTO!r}")
        if self.spill not in SPILL_TARGETS:
            problems.append(f"stream_spill must be one of {list(SPILL_TARGETS)}, got {self.spill!r}")
        if self.spill_dir is not None:
            folder = Path(str(self.spill_dir)).expanduser()
            if not folder.is_dir():
                problems.append(f"stream_spill_dir {str(self.spill_dir)!r} is not an existing folder")
            elif not os.access(folder, os.W_OK | os.X_OK):
                problems.append(f"stream_spill_dir {str(self.spill_dir)!r} is not writable")
        if problems:
            raise ValueError("invalid FeatCal stream options: " + "; ".join(problems))

    @property
    def auto(self) -> bool:
        return self.device_bytes is None or self.device_bytes == AUTO

    def device_budget(self, device: torch.device, reserve_bytes: int) -> Optional[int]:
        """The budget in bytes (None: unbounded), the automatic one leaving ``reserve_bytes`` for the block's work."""
        return auto_device_budget(device, reserve_bytes) if self.auto else parse_bytes(self.device_bytes)


def auto_device_budget(device: torch.device, reserve_bytes: int) -> Optional[int]:
    """Unbounded where the device is the host (spilling to host memory would only copy). On CUDA: a share
    (``AUTO_FREE_FRACTION``) of the memory free now (the calibrated model already placed) less ``reserve_bytes``."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int((free - reserve_bytes) * AUTO_FREE_FRACTION))


# ---- trees of tensors -------------------------------------------------------------------------------------------


def _map_leaves(tree: Any, leaf: type, fn: Callable[[Any], Any]) -> Any:
    """``tree`` with every ``leaf`` instance replaced by ``fn(it)``: through dataclasses (the families' per-batch
    states), dicts, lists and tuples; anything else is kept as it is."""
    if isinstance(tree, leaf):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        out = copy.copy(tree)
        for f in dataclasses.fields(tree):
            object.__setattr__(out, f.name, _map_leaves(getattr(tree, f.name), leaf, fn))
        return out
    if isinstance(tree, dict):
        return type(tree)((k, _map_leaves(v, leaf, fn)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        items = [_map_leaves(v, leaf, fn) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def _owns_its_buffer(t: Tensor) -> bool:
    """False for a view of a slice of a larger buffer (an expanded tensor needs less than its numel: True)."""
    return t.untyped_storage().nbytes() <= t.numel() * t.element_size()


def tree_bytes(tree: Any) -> int:
    """Bytes of the distinct buffers a tree holds, as spilling it would store them."""
    seen: Dict[int, int] = {}

    def count(t: Tensor) -> None:
        if _owns_its_buffer(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            seen[id(t)] = t.numel() * t.element_size()

    _map_leaves(tree, Tensor, count)
    return sum(seen.values())


@dataclass(frozen=True)
class _View:
    """How to rebuild one tensor over buffer ``buffer`` of its parcel."""

    buffer: int
    dtype: torch.dtype
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


def _pack(tree: Any) -> Tuple[Any, List[Tensor]]:
    """The tree with every tensor replaced by a ``_View``, and the distinct buffers as flat uint8 tensors."""
    index: Dict[int, int] = {}
    buffers: List[Tensor] = []

    def view(t: Tensor) -> _View:
        if not _owns_its_buffer(t):
            t = t.clone(memory_format=torch.contiguous_format)
        storage = t.untyped_storage()
        # ``buffers`` keeps every storage alive while packing, so a data pointer names one storage
        key = storage.data_ptr()
        if key not in index:
            index[key] = len(buffers)
            buffers.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        return _View(index[key], t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    return _map_leaves(tree, Tensor, view), buffers


def _unpack(skeleton: Any, buffers: List[Tensor]) -> Any:
    def rebuild(v: _View) -> Tensor:
        buffer = buffers[v.buffer]
        return torch.empty(0, dtype=v.dtype, device=buffer.device).set_(buffer.untyped_storage(), v.offset, v.size, v.stride)

    return _map_leaves(skeleton, _View, rebuild)


# ---- the store ---------------------------------------------------------------------------------------------------


@dataclass
class _Parcel:
    """One tree (a batch's hidden states, or its metadata) where the store put it."""

    nbytes: int
    tree: Any = None  # resident: the tree itself
    skeleton: Any = None  # spilled: the tree with tensors replaced by views of ...
    buffers: Optional[List[Tensor]] = None  # ... these host buffers (spill="host"), or ...
    path: Optional[Path] = None  # ... the buffers saved in this file (spill="disk")

    @property
    def resident(self) -> bool:
        return self.skeleton is None


class StreamStore:
    """Places every batch's parcels on the device within ``budget_bytes`` (None: no limit), the rest in host memory
    or on disk; see the module docstring. A context manager: leaving it drops every stream it made and removes the
    spill folder, whether the run finished, raised or was interrupted."""

    def __init__(self, device, budget_bytes: Optional[int], spill: str = "host", spill_dir: Optional[str] = None,
                 timer: Optional[Callable[[str], Any]] = None):
        if spill not in SPILL_TARGETS:
            raise ValueError(f"spill must be one of {list(SPILL_TARGETS)}, got {spill!r}")
        self.device = torch.device(device)
        self.budget = budget_bytes
        self.spill = spill
        self.spill_dir = spill_dir
        self.pin = self.device.type == "cuda"
        self._timer = timer or (lambda phase: nullcontext())
        self._streams: List[Stream] = []
        self._folder: Optional[Path] = None
        self._remove_folder = None
        self._names = itertools.count()
        self.resident_bytes = self.spilled_bytes = 0
        self.peak_resident_bytes = self.peak_spilled_bytes = self.peak_bytes = 0
        self.written_bytes = self.read_bytes = 0

    def __enter__(self) -> "StreamStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self) -> "Stream":
        stream = Stream(self)
        self._streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self._streams:
            stream._slots.clear()
        self._streams.clear()
        self.resident_bytes = self.spilled_bytes = 0
        if self._remove_folder is not None:
            self._remove_folder()

    def report(self) -> Dict[str, Any]:
        return {
            "device_budget_bytes": self.budget,
            "spill": self.spill,
            "peak_resident_bytes": self.peak_resident_bytes,
            "peak_spilled_bytes": self.peak_spilled_bytes,
            "peak_bytes": self.peak_bytes,
            "spill_written_bytes": self.written_bytes,
            "spill_read_bytes": self.read_bytes,
        }

    # ---- parcels --------------------------------------------------------------------------------------------

    def place(self, tree: Any) -> _Parcel:
        nbytes = tree_bytes(tree)
        if self.budget is None or nbytes == 0 or self.resident_bytes + nbytes <= self.budget:
            self.resident_bytes += nbytes
            parcel = _Parcel(nbytes, tree=tree)
        else:
            with self._timer("streams"):
                parcel = self._spill(tree)
            self.spilled_bytes += parcel.nbytes
            self.written_bytes += parcel.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        self.peak_spilled_bytes = max(self.peak_spilled_bytes, self.spilled_bytes)
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes + self.spilled_bytes)
        return parcel

    def fetch(self, parcel: _Parcel) -> Any:
        if parcel.resident:
            return parcel.tree
        with self._timer("streams"):
            if parcel.path is not None:
                buffers = torch.load(parcel.path, map_location=self.device, weights_only=True)
            else:
                buffers = [b.to(self.device, non_blocking=self.pin) for b in parcel.buffers]
            self.read_bytes += parcel.nbytes
            return _unpack(parcel.skeleton, buffers)

    def drop(self, parcel: _Parcel) -> None:
        if parcel.resident:
            self.resident_bytes -= parcel.nbytes
            return
        self.spilled_bytes -= parcel.nbytes
        if parcel.path is not None:
            parcel.path.unlink(missing_ok=True)

    def _spill(self, tree: Any) -> _Parcel:
        skeleton, buffers = _pack(tree)
        nbytes = sum(b.numel() for b in buffers)
        if self.spill == "disk":
            path = self._spill_folder() / f"{next(self._names)}.pt"
            torch.save([b.cpu() for b in buffers], path)
            return _Parcel(nbytes, skeleton=skeleton, path=path)
        return _Parcel(nbytes, skeleton=skeleton, buffers=[self._to_host(b) for b in buffers])

    def _to_host(self, buffer: Tensor) -> Tensor:
        # a copy even where the device is the host: a spilled parcel owns its bytes
        host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=self.pin)
        return host.copy_(buffer, non_blocking=self.pin)

    def _spill_folder(self) -> Path:
        if self._folder is None:
            base = None if self.spill_dir is None else str(Path(str(self.spill_dir)).expanduser())
            self._folder = Path(tempfile.mkdtemp(prefix="featcal-streams-", dir=base))
            # also at interpreter exit, should the store never be closed
            self._remove_folder = weakref.finalize(self, shutil.rmtree, self._folder, ignore_errors=True)
        return self._folder


_KEEP = object()


class Stream:
    """One model's hidden states (and per-batch metadata) over one task's calibration batches, by batch index."""

    def __init__(self, store: StreamStore):
        self._store = store
        self._slots: List[List[_Parcel]] = []  # per batch: [hidden, meta]

    def __len__(self) -> int:
        return len(self._slots)

    def append(self, hidden: Tensor, meta: Any) -> None:
        self._slots.append([self._store.place(hidden), self._store.place(meta)])

    def get(self, b: int) -> Tuple[Tensor, Any]:
        """Batch ``b``'s hidden states and metadata, on the device."""
        hidden, meta = self._slots[b]
        return self._store.fetch(hidden), self._store.fetch(meta)

    def hidden(self, b: int) -> Tensor:
        return self._store.fetch(self._slots[b][0])

    def put(self, b: int, hidden: Tensor, meta: Any = _KEEP) -> None:
        """Replace batch ``b``'s hidden states (and its metadata, if given)."""
        slot = self._slots[b]
        for i, tree in ((0, hidden), (1, meta)):
            if tree is not _KEEP:
                self._store.drop(slot[i])
                slot[i] = self._store.place(tree)


__all__ = ["AUTO", "SPILL_TARGETS", "Stream", "StreamOptions", "StreamStore", "auto_device_budget", "parse_bytes",
           "tree_bytes"]
