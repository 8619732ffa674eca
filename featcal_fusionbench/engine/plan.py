"""Which sites of each block are calibrated, and the device memory one block's work needs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List

import torch
from torch import nn

from ..core.hparams import FeatCalHParams
from ..families import NORM_KINDS, ModelFamily, Site


@dataclass
class BlockPlan:
    """Which sites of one block are calibrated: relative name -> (full name, kind), and the sites themselves
    (of the model the plan was made for)."""

    index: int
    modules: Dict[str, tuple]
    sites: Dict[str, Site] = field(default_factory=dict)

    def names(self, *kinds: str) -> List[str]:
        return [rel for rel, (_, kind) in self.modules.items() if kind in kinds]


def plan_blocks(family: ModelFamily, model: nn.Module, hparams: FeatCalHParams) -> List[BlockPlan]:
    """Select the sites to calibrate in every block; raise if none is selected."""
    full_names = {id(m): n for n, m in model.named_modules()}
    pattern = re.compile(hparams.module_regex) if hparams.module_regex is not None else None
    plans = []
    for index, block in enumerate(family.blocks(model)):
        selected, sites = {}, {}
        for rel, site in family.sites(block).items():
            if site.kind in NORM_KINDS and (not hparams.calibrate_layernorm or site.weight is None):
                continue
            full = f"{full_names[id(block)]}.{rel}"
            if pattern is not None and not pattern.search(full):
                continue
            selected[rel] = (full, site.kind)
            sites[rel] = site
        plans.append(BlockPlan(index, selected, sites))
    if not any(plan.modules for plan in plans):
        raise ValueError(
            f"no module selected for calibration (module_regex={hparams.module_regex!r}, "
            f"calibrate_layernorm={hparams.calibrate_layernorm}); example module names: "
            + ", ".join(list(full_names.values())[1:6])
        )
    return plans


def block_reserve_bytes(blocks: Iterable[nn.Module], accumulation_dtype: torch.dtype) -> int:
    """Device memory one block's work needs beside the calibrated model, which the automatic stream budget leaves
    free: the base's and an expert's copy of the largest block, and the statistics of its linear maps. For a weight of
    m x d, that is a task's Gram and cross moments and the block's summed Gram (d x d each; counted per module though
    q/k/v share theirs, so an overestimate) and two m x d targets."""
    itemsize = torch.empty((), dtype=accumulation_dtype).element_size()

    def need(block: nn.Module) -> int:
        params = list(block.parameters())
        weights = 2 * sum(p.numel() * p.element_size() for p in params)
        statistics = sum(4 * p.shape[1] ** 2 + 2 * p.numel() for p in params if p.dim() == 2) * itemsize
        return weights + statistics

    return max(need(block) for block in blocks)

