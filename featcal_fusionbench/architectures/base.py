"""The one interface through which the engine sees a model family.

The engine never touches a model's attributes directly: how to enter the first
block, which blocks exist in forward order, which modules inside a block are
calibrated, how tokens are weighted or masked, and how to run one block all
live in an adapter. A new family (T5, Llama-style decoders, OpenCLIP) is one
more subclass; the solver and the engine stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

LINEAR = "linear"
LAYERNORM = "layernorm"
RMSNORM = "rmsnorm"

UNIFORM = "uniform"  # token-weight profile meaning "every token has weight 1"


def to_device(inputs: Any, device: torch.device) -> Any:
    """A tensor, or a dict of them (nested), on ``device``."""
    if isinstance(inputs, Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    return inputs


class ArchitectureAdapter(ABC):
    """How FeatCal walks one model family in forward order."""

    #: short name used in logs and reports
    name: str = "abstract"

    @classmethod
    def from_hparams(cls, hparams) -> "ArchitectureAdapter":
        """Build the adapter from FeatCal's hyperparameters (for family-specific options)."""
        return cls()

    @classmethod
    @abstractmethod
    def supports(cls, model: nn.Module) -> bool:
        """Whether this adapter knows the model's class."""

    @abstractmethod
    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The calibrated blocks in forward order."""

    @abstractmethod
    def stem_modules(self, model: nn.Module) -> List[nn.Module]:
        """Modules that :meth:`embed` runs (moved to the device only while it runs)."""

    @abstractmethod
    def embed(self, model: nn.Module, inputs: Any) -> Tuple[Tensor, Any]:
        """Hidden states entering the first block, and per-batch metadata (masks, ...)."""

    @abstractmethod
    def run_block(self, block: nn.Module, hidden: Tensor, meta: Any) -> Tensor:
        """One block's output hidden states."""

    @abstractmethod
    def make_input_batches(self, modelpool, dataset, batch_size: int) -> Iterable[Any]:
        """Model inputs for calibration examples of one task, in batches (labels unused)."""

    # ---- defaults that most families share -------------------------------------------------

    def enter_block(self, model: nn.Module, index: int, hidden: Tensor, meta: Any) -> Tuple[Tensor, Any]:
        """Transform one stream's state before block ``index`` runs (e.g. encoder to decoder)."""
        return hidden, meta

    def module_kind(self, module: nn.Module) -> Optional[str]:
        if isinstance(module, nn.Linear):
            return LINEAR
        if isinstance(module, nn.LayerNorm):
            return LAYERNORM
        return None

    def calibrated_modules(self, block: nn.Module) -> Dict[str, Tuple[nn.Module, str]]:
        """Relative name -> (module, kind) for every module FeatCal can update in a block."""
        found = {}
        for name, module in block.named_modules():
            kind = self.module_kind(module)
            if kind is not None:
                found[name] = (module, kind)
        return found

    def weight_profile(self, block_index: int, num_blocks: int, module_name: str) -> Hashable:
        """Which token weighting a module's statistics use; modules sharing an input
        and a profile share one set of moments."""
        return UNIFORM

    def token_weights(self, profile: Hashable, hidden: Tensor, meta: Any) -> Optional[Tensor]:
        """Per-token weights of shape hidden.shape[:-1]; None means all ones."""
        return None

    def inputs_to(self, inputs: Any, device: torch.device) -> Any:
        return to_device(inputs, device)

    def valid_token_mask(self, meta: Any, hidden: Tensor) -> Optional[Tensor]:
        """Tokens that exist (not padding), for drift metrics; None means all."""
        return None
