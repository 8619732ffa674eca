"""``${featcal_sweep_job_dir:DEFAULT}``: a multirun job's own output folder (``<sweep dir>/<job number>``), else DEFAULT.

fusion-bench 0.2.33 names its log folder ``${.output_dir}/${hydra:job.config_name}/${now:...}``. Hydra builds each
job of a sweep from the master config and copies the master's resolver cache into it (``OmegaConf.copy_cache`` in
``hydra/_internal/config_loader_impl.py``, ``load_sweep_config``), so ``${now:}`` resolves to the same time in every
job, and every job wrote its program report, its method's reports and its TensorBoard log into one folder. Hydra
itself gives each job a folder of its own, ``hydra.runtime.output_dir`` (set in ``hydra/core/utils.py`` ``run_job``
before the task function runs); in a multirun the log folder is that one. A single run keeps FusionBench's folder
(there ``hydra.run.dir`` is ``${path.log_dir}`` itself).
"""

from __future__ import annotations

from omegaconf import OmegaConf

RESOLVER = "featcal_sweep_job_dir"


def sweep_job_dir(default: str) -> str:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return default
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN and hydra.runtime.output_dir:
        return str(hydra.runtime.output_dir)
    return default


def register() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, sweep_job_dir)
