"""What the task YAMLs of this folder name with ``!function scorers.<name>``."""

# Absolute: lm-eval loads this file by its path, outside the package.
from featcal_fusionbench.evaluation.lm_eval_scoring import (  # noqa: F401
    humaneval_plus_process_results,
    humanevalplus_bigcode_process_results,
    math500_process_results,
    mbpp_plus_process_results,
    mbppplus_bigcode_process_results,
)
