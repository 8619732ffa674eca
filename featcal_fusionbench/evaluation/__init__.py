"""Evaluation, apart from any method: FusionBench task pools and what scores them.

The CLIP task pool for local or offline data (``clip_taskpool``), the text-generation task pool for seq2seq models
(``text_taskpool``), lm-evaluation-harness as a task pool (``lm_eval_taskpool``) with our task files
(``lm_eval_tasks``), their scorers (``lm_eval_scoring``), the sandbox that runs generated programs
(``code_execution``) and NLTK's Punkt model for IFEval (``nltk_data``). Nothing here knows FeatCal or the baselines:
a task pool evaluates whatever model FusionBench hands it (``models.task_switch`` tells it which task is scored).
"""
