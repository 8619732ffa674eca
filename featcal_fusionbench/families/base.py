"""The one interface through which FeatCal, Surgery and ProbSurgery see a model family.

Everything family-specific lives in a subclass: which blocks exist in forward order and how to walk
them, the calibrated sites of a block, token weights and masks, family options, how calibration
examples are batched, and where Surgery's and ProbSurgery's maps sit. The engine and the baselines
know no family; a new one is a module with a subclass registered by ``@register_family``.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from .sites import Site

UNIFORM = "uniform"  # token-weight profile meaning "every token has weight 1"


def to_device(inputs: Any, device: torch.device) -> Any:
    """A tensor, or a dict of them (nested), on ``device``."""
    if isinstance(inputs, Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    return inputs


def batch_loader(dataset, batch_size: int, shuffle: bool, seed: int, collate_fn=None) -> Iterator[Any]:
    """One ordered pass (``shuffle=False``: FeatCal, and precomputed baseline features), or endless seeded
    shuffled batches (the baselines' streamed training)."""
    if not shuffle:
        return iter(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn))
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=generator,
        drop_last=len(dataset) >= batch_size, collate_fn=collate_fn,
    )
    return (batch for _ in itertools.count() for batch in loader)


class ImagesOnly(Dataset):
    """A classification dataset's images with a dummy label: calibration and ``auto_select`` are label-free, so
    they never read a label (``ImageClassificationDataset`` would return the row's)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        row = self.dataset[index]
        image = row["image"] if isinstance(row, Mapping) else row[0]
        return {"image": image, "label": -1}


class FeatureSite(ABC):
    """Where Surgery's and ProbSurgery's per-task maps act: rows of a (N, dim) feature matrix."""

    dim: int
    one_row_per_example: bool = True  # False where the rows are tokens (T5's targets, a causal LM's counted tokens)

    def to(self, device) -> "FeatureSite":
        return self

    @abstractmethod
    def features(self, model: nn.Module, inputs: Any) -> Tensor:
        """The feature rows of one batch (one per image, or one per target token)."""

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        """What the task pool evaluates: the wrapper itself, or the model with the maps hooked in."""
        return wrapper


class OutputSite(ABC):
    """What a generating family's task pool scores: each example's own greedy output. auto_select's ``site`` reads
    it on such a family (FLAN-T5), where the feature site has a row per token: per held-out example, the probability
    the task's expert gives the model's output."""

    @abstractmethod
    def generate(self, model: nn.Module, inputs: Any) -> Tensor:
        """The model's greedy output for one batch, as the family's task pool generates it."""

    @abstractmethod
    def probability(self, expert: nn.Module, inputs: Any, outputs: Tensor) -> Tensor:
        """Per example of the batch, the expert's probability of ``outputs`` (float32, in [0, 1])."""

    #: the pool's tokenizer, which reads the outputs as text; None: they are read as tokens only
    tokenizer: Any = None

    def texts(self, outputs: Tensor) -> List[str]:
        """``outputs`` as text, decoded as FusionBench's text task pools decode them before they compare
        (``evaluate_accuracy``, ``evaluate_spearman_rho``)."""
        return self.tokenizer.batch_decode(outputs, skip_special_tokens=True)


class ModelFamily(ABC):
    """How the methods walk, calibrate and batch one family of models.

    ``options`` declares the family's options and their defaults (``method.family_options.<name>``);
    ``check_option`` validates one value.
    """

    #: registry key, also reported
    name: ClassVar[str] = "abstract"
    #: option name -> default
    options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"the {self.name} family has no option(s) {unknown}; its options: {known}")
        values = {**self.options, **options}
        problems = [p for key, value in values.items() for p in [self.check_option(key, value)] if p]
        if problems:
            raise ValueError(f"invalid {self.name} family option(s): " + "; ".join(problems))
        self.option_values: Dict[str, Any] = values

    def check_option(self, name: str, value: Any) -> Optional[str]:
        """A message naming what is wrong with an option's value, or None."""
        return None

    @staticmethod
    def non_negative_number(name: str, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"{name} must be a finite number >= 0, got {value!r}"
        return None

    # ---- which models -------------------------------------------------------------------------

    @classmethod
    def shapes_may_differ(cls, model: nn.Module) -> Tuple[str, ...]:
        """State-dict keys whose shapes may differ between the base and an expert: parameters the family never
        calibrates and that each model only reads in its own forward (e.g. an expert's larger vocabulary)."""
        return ()

    @classmethod
    @abstractmethod
    def supports(cls, model: nn.Module) -> bool:
        """Whether this family knows the model's class."""

    def check_models(self, modelpool, model: nn.Module) -> None:
        """Fail on a pool whose models this family would calibrate wrongly (``model``: its loaded base), before
        the upstream merge runs; the default finds nothing to check."""

    # ---- the block walk ------------------------------------------------------------------------

    @abstractmethod
    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The calibrated blocks in forward order."""

    @abstractmethod
    def stem_modules(self, model: nn.Module) -> List[nn.Module]:
        """Modules that :meth:`embed` and :meth:`enter_block` run (on the device only while they run)."""

    @abstractmethod
    def embed(self, model: nn.Module, inputs: Any) -> Tuple[Tensor, Any]:
        """Hidden states entering the first block, and per-batch metadata (masks, ...)."""

    @abstractmethod
    def run_block(self, block: nn.Module, hidden: Tensor, meta: Any) -> Tensor:
        """One block's output hidden states."""

    def enter_block(self, model: nn.Module, index: int, hidden: Tensor, meta: Any) -> Tuple[Tensor, Any]:
        """Transform one stream's state before block ``index`` runs (e.g. encoder to decoder)."""
        return hidden, meta

    def inputs_to(self, inputs: Any, device: torch.device) -> Any:
        return to_device(inputs, device)

    # ---- what is calibrated, and on which tokens -------------------------------------------------

    @abstractmethod
    def sites(self, block: nn.Module) -> Dict[str, Site]:
        """Relative name -> site, for every unit FeatCal can update in a block, in forward order.

        For a site that is one module, the name is the module's name relative to the block, so
        reports and ``module_regex`` see the model's own module names.
        """

    def weight_profile(self, block_index: int, num_blocks: int, site_name: str) -> Hashable:
        """Which token weighting a site's statistics use; sites sharing an input and a profile share
        one set of moments."""
        return UNIFORM

    def token_weights(self, profile: Hashable, hidden: Tensor, meta: Any, dtype: torch.dtype) -> Optional[Tensor]:
        """Per-token weights of shape hidden.shape[:-1] in ``dtype`` (the moments'); None means all ones."""
        return None

    def valid_token_mask(self, meta: Any, hidden: Tensor) -> Optional[Tensor]:
        """Tokens that exist (not padding), for drift metrics; None means all."""
        return None

    # ---- predictions (auto_select's agreement criterion) ------------------------------------------

    def head_modules(self, model: nn.Module) -> Optional[List[nn.Module]]:
        """Modules that :meth:`predict` runs after the last block, or None where the family's model has no
        prediction head of its own (CLIP vision towers: the zero-shot head lives in the task pool)."""
        return None

    def predict(self, model: nn.Module, hidden: Tensor, meta: Any) -> Tensor:
        """Logits over the last axis from the last block's output (only where :meth:`head_modules` is not None)."""
        raise NotImplementedError(f"the {self.name} family has no prediction head")

    # ---- data ----------------------------------------------------------------------------------

    @abstractmethod
    def batches(self, modelpool, dataset, batch_size: int, shuffle: bool = False, seed: int = 0) -> Iterator[Any]:
        """Model inputs for one task's calibration examples (labels only where the model reads them)."""

    # ---- the baselines -------------------------------------------------------------------------

    def output_site(self, tokenizer: Any = None) -> Optional[OutputSite]:
        """The generated output that auto_select's ``site`` scores where the feature site has a row per token, or
        None (the family is scored at its feature site, or not at all). ``tokenizer``: the pool's, which decodes it."""
        return None

    def feature_site(self, modelpool, model: nn.Module) -> FeatureSite:
        raise TypeError(
            f"Surgery and ProbSurgery have no feature site for the {self.name} family ({type(model).__name__})"
        )
