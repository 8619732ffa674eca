"""What the task YAMLs of this folder name with ``!function scorers.<name>``."""

from featcal_fusionbench.lm_eval_scoring import (  # noqa: F401
    humaneval_plus_process_results,
    math500_process_results,
    mbpp_plus_process_results,
)
