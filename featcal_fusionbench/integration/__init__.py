"""FeatCal in FusionBench and Hydra: everything that knows a FusionBench pool, a task pool, a config or the hub.

The method (``algorithm``) and what it shares with the baselines (``post_merging``: the pool checks and the
post-merging contract; ``upstream``: the merger it runs after; ``data``, ``text_data``, ``glue``: the calibration
data), the merged model read block by block and the run's fingerprint (``out_of_core``), which models are held whole
(``memory``), FusionBench's OpenCLIP pools (``openclip_pools``), the pools' names (``pool_names``), the hub
(``hub_access``), version shims (``compat``) and the results table (``reporting``). The task pools and their scorers
are a layer of their own (``evaluation``); ``taskpool`` and ``lm_eval_taskpool`` here are their former paths, which
worlds built earlier name in their configs.
"""
