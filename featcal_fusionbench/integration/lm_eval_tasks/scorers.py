"""What the task YAMLs of this folder name with ``!function scorers.<name>``."""

from ..lm_eval_scoring import humaneval_plus_process_results, math500_process_results, mbpp_plus_process_results
