"""A run's fingerprint, stored with a partial output so that a resumed run is refused when its configuration, its
calibration examples or its input models changed (``models.checkpoint_writer`` keeps it with the finished blocks)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..models.lazy import entry_path


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value (keys sorted; other objects by their text)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _feed(hasher, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        hasher.update(f"{value.dtype}{tuple(value.shape)}".encode())
        hasher.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            hasher.update(str(key).encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(hasher, item)
    elif hasattr(value, "tobytes"):  # numpy arrays, PIL images
        hasher.update(repr(getattr(value, "size", getattr(value, "shape", ""))).encode())
        hasher.update(value.tobytes())
    else:
        hasher.update(repr(value).encode())


def data_fingerprint(datasets: Mapping[str, Any]) -> str:
    """A hash of every task's selected calibration examples, read example by example."""
    hasher = hashlib.sha256()
    for task in sorted(datasets):
        hasher.update(task.encode())
        dataset = datasets[task]
        for i in range(len(dataset)):
            _feed(hasher, dataset[i])
    return hasher.hexdigest()[:16]


def models_fingerprint(modelpool, merged_model_path: Optional[str]) -> str:
    """The input models as named (pool entries, ``merged_model_path``) and, where they are local, their files'
    names, sizes and modification times: a checkpoint saved again is a changed input."""
    entries = {name: modelpool.get_model_config(name, return_copy=True) for name in modelpool.all_model_names}
    if merged_model_path is not None:
        entries["merged_model_path"] = merged_model_path
    described = {}
    for name, entry in entries.items():
        path = entry_path(entry) if not isinstance(entry, str) else entry
        files = []
        if path is not None and os.path.exists(path):
            root = Path(path)
            for file in sorted(root.rglob("*") if root.is_dir() else [root]):
                if file.is_file():
                    stat = file.stat()
                    files.append((str(file.relative_to(root)) if root.is_dir() else file.name, stat.st_size,
                                  stat.st_mtime_ns))
        described[name] = {"entry": repr(entry), "files": files}
    return digest(described)


__all__ = ["data_fingerprint", "digest", "models_fingerprint"]
