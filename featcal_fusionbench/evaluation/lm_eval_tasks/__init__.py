"""lm-eval task files of ours for Table 4 (``LMEvalTaskPool`` adds this folder to lm-eval's task index).

Each task that lm-eval 0.4.13 scores wrongly for an Instruct model's reply has a file here, named for what it is;
the scorers are ``featcal_fusionbench.evaluation.lm_eval_scoring`` (``scorers.py`` is the module lm-eval's ``!function``
resolves beside the YAML files). docs/families/causal_lm.md gives each column's protocol and its source.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
