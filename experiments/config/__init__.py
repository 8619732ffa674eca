"""The offline worlds' FusionBench pool and task-pool configs, shipped as ``featcal_experiments_config``."""
