"""FeatCal in FusionBench and Hydra: everything that knows a FusionBench pool, a task pool, a config or the hub.

The method (``algorithm``) and what it shares with the baselines (``post_merging``: the pool checks and the
post-merging contract; ``upstream``: the merger it runs after; ``data``, ``text_data``, ``glue``: the calibration
data), the task pools (``taskpool``, ``text_taskpool``, ``lm_eval_taskpool`` with ``lm_eval_tasks``,
``lm_eval_scoring``, ``code_execution``, ``nltk_data``; ``openclip_pools``), the pools' names (``pool_names``), the
hub (``hub_access``), version shims (``compat``) and the results table (``reporting``).
"""
