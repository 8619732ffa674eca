"""A Hugging Face safetensors checkpoint written a few tensors at a time, complete or not at all.

The out-of-core path writes each calibrated block as soon as it is solved, so the checkpoint grows shard by shard
(one per ``write``) with the index that ``from_pretrained`` reads (``model.safetensors.index.json``: tensor name ->
shard). Everything goes into a hidden temporary folder beside the target; ``commit`` renames it into place, and
leaving the context without a commit (an error, Ctrl-C, a full disk) removes it: no folder that looks complete is
ever left behind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

import torch

from .lazy import SAFETENSORS_INDEX

log = logging.getLogger(__name__)


class CheckpointWriter:
    """``with CheckpointWriter(path, expected_bytes) as out: out.write({...}); ...; out.commit(extra)``."""

    def __init__(self, path, expected_bytes: int = 0):
        self.path = Path(path).expanduser().absolute()
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"the calibrated model's output {self.path} exists and is not a folder")
        self.expected_bytes = expected_bytes
        self.temporary = self.path.parent / f".{self.path.name}.partial-{os.getpid()}"
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0
        self.committed = False

    def __enter__(self) -> "CheckpointWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.path.parent).free
        if self.expected_bytes > free:
            raise OSError(
                errno.ENOSPC,
                f"the calibrated model needs {self.expected_bytes / 2**30:.2f} GiB and {self.path.parent} has "
                f"{free / 2**30:.2f} GiB free",
            )
        shutil.rmtree(self.temporary, ignore_errors=True)  # a previous run of this very process id
        self.temporary.mkdir()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if not self.committed:
            shutil.rmtree(self.temporary, ignore_errors=True)
            log.info("the partial checkpoint %s was removed", self.temporary)

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """One shard holding ``tensors`` (moved to host memory; its names must be new)."""
        if not tensors:
            return
        from safetensors.torch import save_file

        repeated = [name for name in tensors if name in self.weight_map]
        if repeated:
            raise ValueError(f"tensors written twice: {repeated[:3]}")
        shard = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        self._guard(lambda: save_file(host, str(self.temporary / shard), metadata={"format": "pt"}))
        self.weight_map.update(dict.fromkeys(host, shard))
        self.total_bytes += sum(t.nbytes for t in host.values())

    def commit(self, save_extra: Optional[Callable[[Path], None]] = None) -> Path:
        """Write the index (and what ``save_extra`` writes into the folder: config, tokenizer), then rename the
        folder into place, replacing an older one only once the new one is complete."""

        def finish():
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.temporary / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
            if save_extra is not None:
                save_extra(self.temporary)

        self._guard(finish)
        old = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
        if self.path.exists():
            self.path.rename(old)
        try:
            self.temporary.rename(self.path)
        except BaseException:
            if old.exists():
                old.rename(self.path)  # the older output stays where it was
            raise
        self.committed = True
        shutil.rmtree(old, ignore_errors=True)
        return self.path

    def _guard(self, work: Callable[[], None]) -> None:
        try:
            work()
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    error.errno,
                    f"the disk filled while the calibrated model was written to {self.path} "
                    f"({self.total_bytes / 2**30:.2f} GiB written of about {self.expected_bytes / 2**30:.2f} GiB); "
                    "the partial output is removed",
                ) from error
            raise


__all__ = ["CheckpointWriter"]
