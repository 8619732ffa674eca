"""A Hugging Face safetensors checkpoint written a few tensors at a time, complete or not at all, and resumable.

The out-of-core path writes each calibrated block as soon as it is solved, so the checkpoint grows shard by shard
(one per ``write``) with the index that ``from_pretrained`` reads (``model.safetensors.index.json``: tensor name ->
shard). Everything goes into a hidden partial folder beside the target (``.NAME.partial``), which holds no index
until ``commit`` writes it and renames the folder into place: no folder that looks complete is ever left behind.

Without a ``fingerprint``, leaving the context without a commit (an error, Ctrl-C, a full disk) removes the partial
folder. With one, the partial folder is a run's progress: each block written with ``write_block`` is recorded in
``featcal_progress.json`` (with the fingerprint of what the run depends on and the block's report entry) only once
its shard is on disk, and the folder stays when the run stops (killed, out of memory, preempted), so that the same
command resumes after the last recorded block. A partial folder of another fingerprint is refused, naming what
changed. A full disk still removes it (the space is the problem). A lock held while a process writes keeps a second
run off the same output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from .lazy import SAFETENSORS_INDEX

log = logging.getLogger(__name__)

PROGRESS = "featcal_progress.json"
LOCK = ".lock"


def file_mode() -> int:
    """The mode a new file gets here (0o666 less the umask), as ``open`` gives it: safetensors 0.8's ``save_file``
    writes through a temporary file and leaves every shard 0o600 (safetensors issue #782), so another account (a
    server, a colleague) could read the config but not the weights. Linux reports the umask in /proc; elsewhere it
    is read by setting it and putting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def human_bytes(size: float) -> str:
    """``size`` in the largest binary unit that keeps it at least 1 (a 3 MiB model is not "0.00 GiB")."""
    units = ("KiB", "MiB", "GiB", "TiB")
    if abs(size) < 1024:
        return f"{size:.0f} B"
    for unit in units:
        size /= 1024
        if abs(size) < 1024 or unit == units[-1]:
            return f"{size:.2f} {unit}"


def partial_folder(path) -> Path:
    """Where the checkpoint for ``path`` is written until it is complete."""
    path = Path(path).expanduser().absolute()
    return path.parent / f".{path.name}.partial"


def read_progress(folder) -> Optional[Dict[str, Any]]:
    """A partial folder's recorded progress (fingerprint and finished blocks), or None."""
    file = Path(folder) / PROGRESS
    if not file.is_file():
        return None
    return json.loads(file.read_text())


class CheckpointWriter:
    """``with CheckpointWriter(path, expected_bytes) as out: out.write({...}); ...; out.commit(extra)``."""

    def __init__(self, path, expected_bytes: int = 0, fingerprint: Optional[Mapping[str, str]] = None,
                 label: str = "the calibrated model"):
        self.path = Path(path).expanduser().absolute()
        self.label = label
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"{label}'s output {self.path} exists and is not a folder")
        self.expected_bytes = expected_bytes
        self.fingerprint = None if fingerprint is None else dict(fingerprint)
        self.temporary = partial_folder(self.path)
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0
        self.blocks: Dict[str, Dict[str, Any]] = {}  # recorded blocks, by index as text (JSON's keys)
        self.committed = False
        self._lock = None
        self.file_mode = file_mode()

    def __enter__(self) -> "CheckpointWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        progress = read_progress(self.temporary) if self.fingerprint is not None else None
        if progress is not None:
            self._check_fingerprint(progress.get("fingerprint", {}))
        free = shutil.disk_usage(self.path.parent).free
        needed = self.expected_bytes - sum(b["bytes"] for b in (progress or {}).get("blocks", {}).values())
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"{self.label} needs {human_bytes(needed)} and {self.path.parent} has {human_bytes(free)} free",
            )
        if progress is None:
            self._lock_folder(fresh=True)
            if self.fingerprint is not None:
                self._save_progress()
            return self
        self._lock_folder(fresh=False)
        self.blocks = progress["blocks"]
        for block in self.blocks.values():
            self.weight_map.update(dict.fromkeys(block["tensors"], block["shard"]))
            self.total_bytes += block["bytes"]
        for stale in self.temporary.glob("*.safetensors"):  # written after the last recorded block, or the rest
            if stale.name not in self.weight_map.values():
                stale.unlink()
        log.info("resuming %s from %s: %d block(s) already written", self.label, self.temporary, len(self.blocks))
        return self

    def __exit__(self, kind, error, traceback) -> None:
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        if not self.committed and (self.fingerprint is None or full or kind is None):
            shutil.rmtree(self.temporary, ignore_errors=True)
            log.info("the partial checkpoint %s was removed", self.temporary)
        elif not self.committed:
            log.warning("%s stopped after %d block(s); they are kept in %s and the same command resumes there",
                        self.label, len(self.blocks), self.temporary)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _lock_folder(self, fresh: bool) -> None:
        if fresh:
            self._check_unlocked()
            shutil.rmtree(self.temporary, ignore_errors=True)  # a partial output of no recorded progress
            self.temporary.mkdir()
        self._lock = open(self.temporary / LOCK, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(f"another run is writing {self.path} (its partial output {self.temporary} is locked)")

    def _check_unlocked(self) -> None:
        if not (self.temporary / LOCK).exists():
            return
        with open(self.temporary / LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(
                    f"another run is writing {self.path} (its partial output {self.temporary} is locked)") from None

    def _check_fingerprint(self, stored: Mapping[str, str]) -> None:
        changed = sorted(k for k in {**stored, **self.fingerprint} if stored.get(k) != self.fingerprint.get(k))
        if changed:
            raise ValueError(
                f"{self.path} has a partial output from a stopped run ({self.temporary}) whose "
                f"{', '.join(changed)} differ(s) from this run's, so it cannot be resumed; to start over, remove "
                f"{self.temporary} (or write to another path), or run the stopped run's command again to finish it"
            )

    def _save_progress(self) -> None:
        progress = {"fingerprint": self.fingerprint, "blocks": self.blocks}
        staged = self.temporary / f"{PROGRESS}.staged"
        staged.write_text(json.dumps(progress, indent=1))
        os.replace(staged, self.temporary / PROGRESS)  # a block counts as written once this lands

    def write_block(self, index: int, tensors: Mapping[str, torch.Tensor], entry: Optional[Mapping] = None) -> None:
        """One block's shard, recorded (with its report ``entry``) as finished once it is on disk."""
        shard = self.write(tensors)
        if self.fingerprint is None or shard is None:
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.blocks[str(index)] = {"shard": shard, "tensors": sorted(tensors), "bytes": nbytes,
                                   "entry": dict(entry or {})}
        self._guard(self._save_progress)

    def write(self, tensors: Mapping[str, torch.Tensor]) -> Optional[str]:
        """One shard holding ``tensors`` (moved to host memory; its names must be new); its file name (None when
        there is nothing to write)."""
        if not tensors:
            return None
        from safetensors.torch import save_file

        repeated = [name for name in tensors if name in self.weight_map]
        if repeated:
            raise ValueError(f"tensors written twice: {repeated[:3]}")
        shard = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        path = self.temporary / shard

        def save():
            save_file(host, str(path), metadata={"format": "pt"})
            os.chmod(path, self.file_mode)

        self._guard(save)
        self.weight_map.update(dict.fromkeys(host, shard))
        self.total_bytes += sum(t.nbytes for t in host.values())
        return shard

    def commit(self, save_extra: Optional[Callable[[Path], None]] = None) -> Path:
        """Write the index (and what ``save_extra`` writes into the folder: config, tokenizer), then rename the
        folder into place, replacing an older one only once the new one is complete."""

        def finish():
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.temporary / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
            if save_extra is not None:
                save_extra(self.temporary)
            for bookkeeping in (PROGRESS, LOCK):
                (self.temporary / bookkeeping).unlink(missing_ok=True)

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
                    f"the disk filled while {self.label} was written to {self.path} "
                    f"({human_bytes(self.total_bytes)} written of about {human_bytes(self.expected_bytes)}); "
                    "the partial output is removed",
                ) from error
            raise


__all__ = ["CheckpointWriter", "file_mode", "human_bytes", "partial_folder", "read_progress"]
