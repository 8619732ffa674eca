"""Where a calibrated (or upstream) model goes, block by block: kept in memory, or written as a checkpoint.

The calibration loop hands every finished block to a sink (``block``), then the sink is ``finish``ed once. The
in-memory sink keeps nothing apart (the model itself holds the blocks). The checkpoint sink writes each block as one
shard the moment it is done and, at the end, the tensors outside the blocks a module at a time, the config and the
tokenizer (``models.checkpoint_writer``: complete or absent, and resumable: a stopped run's finished blocks are
kept, and ``done`` gives them back). With several processes, rank 0 writes and the others wait for it at each
block, so that no rank runs ahead of what is on disk.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from .checkpoint_writer import CheckpointWriter, partial_folder, read_progress
from .lazy import tied_names
from .residency import on_device

log = logging.getLogger(__name__)


def model_bytes(model: nn.Module) -> int:
    """One model's parameter bytes, a tied tensor counted once (a lazy skeleton holds tied ones apart)."""
    aliases, seen, total = tied_names(model), set(), 0
    for name, parameter in model.named_parameters():
        if not set(aliases.get(name, ())) & seen:
            total += parameter.numel() * parameter.element_size()
        seen.add(name)
    return total


def module_prefix(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def write_rest(model: nn.Module, blocks: List[nn.Module], writer: CheckpointWriter) -> None:
    """Every parameter outside the blocks, as ``model`` holds it, one module at a time; a tied output embedding is
    left to the input one, as ``save_pretrained`` leaves it."""
    inside = {id(m) for block in blocks for m in block.modules()}
    aliases = tied_names(model)
    written: set = set(writer.weight_map)
    for prefix, module in model.named_modules():
        if id(module) in inside:
            continue
        own = [name for name, _ in module.named_parameters(recurse=False)]
        keys = {name: f"{prefix}.{name}" if prefix else name for name in own}
        keys = {name: key for name, key in keys.items() if not set(aliases.get(key, ())) & written}
        if not keys:
            continue
        with on_device([module], "cpu"):
            writer.write({key: getattr(module, name) for name, key in keys.items()})
        written.update(keys.values())


class MemorySink:
    """The model stays in memory: nothing to write, nothing to resume."""

    def __enter__(self) -> "MemorySink":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def done(self, index: int) -> Optional[Dict[str, Any]]:
        return None

    def block(self, index: int, block: nn.Module, entry: Optional[Mapping[str, Any]] = None) -> None:
        pass

    def finish(self) -> None:
        return None


class CheckpointSink:
    """``model``'s blocks written to ``path`` as they finish (``block``), the rest and ``save_extra``'s files at
    ``finish``. ``writer``: whether this process writes (rank 0); ``barrier``: called by every process after each
    block and at the ends. ``fingerprint``: what the run depends on, stored beside the shards: a partial output of
    the same fingerprint is resumed (``done``), one of another is refused."""

    def __init__(self, path, model: nn.Module, blocks: List[nn.Module], *, fingerprint: Mapping[str, str],
                 save_extra: Optional[Callable[[Any], None]] = None, writer: bool = True,
                 barrier: Optional[Callable[[], None]] = None, label: str = "the calibrated model"):
        self.model = model
        self.blocks = blocks
        self.save_extra = save_extra
        self.barrier = barrier or (lambda: None)
        self.writer = CheckpointWriter(path, model_bytes(model), fingerprint=fingerprint, label=label) if writer else None
        self.path = path
        self.prefixes = [module_prefix(model, block) for block in blocks]  # the blocks' names in the checkpoint
        self.resumed: Dict[int, Dict[str, Any]] = {}  # block index -> its recorded shard and report entry

    def __enter__(self) -> "CheckpointSink":
        try:
            if self.writer is not None:
                self.writer.__enter__()
        finally:
            self.barrier()  # rank 0 has checked (and kept or cleared) the partial output, or failed
        progress = read_progress(partial_folder(self.path)) or {"blocks": {}}
        self.resumed = {int(index): block for index, block in progress["blocks"].items()}
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self.writer is not None:
            self.writer.__exit__(kind, error, traceback)

    def done(self, index: int) -> Optional[Dict[str, Any]]:
        """A resumed run's block ``index`` as it was written: ``state``, its tensors under the block's own names,
        and ``entry``, its report entry; else None."""
        if index not in self.resumed:
            return None
        from safetensors.torch import load_file

        tensors = load_file(str(partial_folder(self.path) / self.resumed[index]["shard"]))
        cut = len(self.prefixes[index]) + 1
        return {"state": {key[cut:]: value for key, value in tensors.items()}, "entry": self.resumed[index]["entry"]}

    def block(self, index: int, block: nn.Module, entry: Optional[Mapping[str, Any]] = None) -> None:
        if self.writer is not None and index not in self.resumed:
            prefix = self.prefixes[index]
            tensors: Dict[str, torch.Tensor] = {f"{prefix}.{k}": v for k, v in block.state_dict().items()}
            self.writer.write_block(index, tensors, entry)
        self.barrier()

    def finish(self):
        if self.writer is not None:
            write_rest(self.model, self.blocks, self.writer)
            self.writer.commit(self.save_extra)
            log.info("%s was written to %s", self.writer.label, self.writer.path)
        self.barrier()
        return self.path


__all__ = ["CheckpointSink", "MemorySink", "model_bytes", "module_prefix", "write_rest"]
