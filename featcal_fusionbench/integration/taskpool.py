"""The former path of the CLIP task pool, which the offline worlds built before 2026-11-27 name in their task-pool
configs (``featcal-world build`` writes them once): it lives in ``evaluation.clip_taskpool`` now."""

from ..evaluation.clip_taskpool import LocalCLIPVisionModelTaskPool

__all__ = ["LocalCLIPVisionModelTaskPool"]
