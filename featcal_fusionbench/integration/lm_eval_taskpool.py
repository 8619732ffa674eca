"""The former path of the lm-eval task pool, which the offline LLM worlds built before 2026-11-27 name in their
task-pool configs: it lives in ``evaluation.lm_eval_taskpool`` now."""

from ..evaluation.lm_eval_taskpool import LMEvalTaskPool

__all__ = ["LMEvalTaskPool"]
