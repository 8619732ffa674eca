"""The model pools of the paper's tables by their short names, and the task pool that evaluates each.

FusionBench 0.2.33 keeps its pools under class folders (``modelpool=CLIPVisionModelPool/clip-vit-base-patch32_TA8``);
its older releases, its papers' READMEs and many users' scripts name them without the folder. Each short name here
has a config, ``config/modelpool/<short>.yaml``, whose only content is the long one (``defaults: [<long>@_here_]``),
so both compose to the same pool. Hydra cannot choose another group's option from inside a pool config, so the
matching task pool is not chosen for the user: a run whose task pool is FusionBench's default (``dummy``, which
evaluates nothing) on one of these pools is warned at its start with the exact ``taskpool=...`` to add.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaperPool:
    modelpool: str  # FusionBench's config name, with its class folder
    taskpool: str
    taskpool_overrides: Tuple[str, ...] = ()

    @property
    def taskpool_args(self) -> str:
        return " ".join((f"taskpool={self.taskpool}", *self.taskpool_overrides))


CLIP_ARCHS = {"base-patch32": "", "base-patch16": "_B16", "large-patch14": "_L14"}  # -> FusionBench's TA8 suffix


def _clip_pools() -> Dict[str, PaperPool]:
    pools = {}
    for arch, ta8_suffix in CLIP_ARCHS.items():
        for suite in ("TA8", "TALL14", "TALL20"):
            short = f"clip-vit-{arch}_{suite}"
            if suite == "TA8":  # FusionBench has a TA8 task pool per architecture, TALL14 / TALL20 for B/32 only
                pool = PaperPool(f"CLIPVisionModelPool/{short}", f"CLIPVisionModelTaskPool/clip-vit-classification_TA8{ta8_suffix}")
            else:
                pool = PaperPool(f"CLIPVisionModelPool/{short}", f"CLIPVisionModelTaskPool/clip-vit-classification_{suite}",
                                 () if arch == "base-patch32" else (f"taskpool.base_model=openai/clip-vit-{arch}",))
            pools[short] = pool
    return pools


PAPER_POOLS: Dict[str, PaperPool] = {
    **_clip_pools(),
    # GLUE's eight tasks with the average FusionBench's text task pool leaves out (config/taskpool/)
    "flan-t5-base_glue": PaperPool("Seq2SeqLMPool/flan-t5-base_glue", "flan-t5_glue_text_generation_average"),
    "flan-t5-large_glue_lora16": PaperPool("Seq2SeqLMPool/flan-t5-large_glue_lora16", "flan-t5_glue_text_generation_average"),
}
_BY_LONG = {pool.modelpool: pool for pool in PAPER_POOLS.values()}


def config_text(short: str) -> str:
    """What ``config/modelpool/<short>.yaml`` holds."""
    pool = PAPER_POOLS[short]
    return (f"# `modelpool={short}`: FusionBench's `modelpool={pool.modelpool}` under its short name; evaluate it with\n"
            f"# `{pool.taskpool_args}`.\n"
            f"defaults:\n  - {pool.modelpool}@_here_\n  - _self_\n")


def taskpool_hint(choices: Dict[str, Optional[str]]) -> Optional[str]:
    """The ``taskpool=...`` to add when Hydra's ``choices`` pair a paper pool with FusionBench's default task pool."""
    if choices.get("taskpool") not in (None, "dummy"):
        return None
    pool = PAPER_POOLS.get(choices.get("modelpool") or "") or _BY_LONG.get(choices.get("modelpool") or "")
    return pool.taskpool_args if pool else None


def warn_if_nothing_is_evaluated() -> Optional[str]:
    """Under the `fusion_bench` CLI, warn (and return the hint) when the run will evaluate nothing on a paper pool."""
    try:
        from hydra.core.hydra_config import HydraConfig

        choices = dict(HydraConfig.get().runtime.choices)
    except (ImportError, ValueError):  # not under Hydra: the caller evaluates (or not) by itself
        return None
    hint = taskpool_hint(choices)
    if hint:
        log.warning("modelpool=%s with FusionBench's default task pool evaluates nothing; for the paper's accuracies "
                    "add: %s", choices.get("modelpool"), hint)
    return hint
