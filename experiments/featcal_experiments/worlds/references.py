"""Reference rows of a world through FusionBench's task pool: the pretrained model zero-shot and each expert on its
own task, evaluated exactly as the merged models are."""

from __future__ import annotations

from typing import Dict, Iterable, Optional

from .registry import pool_configs


def reference_accuracies(world: str, modelpool: Optional[str] = None, taskpool: Optional[str] = None) -> Dict:
    import lightning as L

    from fusion_bench.utils import instantiate

    pool_cfg, taskpool_cfg = pool_configs(world, modelpool, taskpool)
    pool = instantiate(pool_cfg)
    fabric = L.Fabric(accelerator="cpu", devices=1)

    def evaluate(model, tasks: Iterable[str]) -> Dict[str, float]:
        tasks = list(tasks)
        cfg = taskpool_cfg.copy()
        cfg.test_datasets = {t: cfg.test_datasets[t] for t in tasks}
        taskpool_ = instantiate(cfg)
        taskpool_._fabric_instance = fabric
        report = taskpool_.evaluate(model)
        return {t: report[t]["accuracy"] for t in tasks}

    tasks = list(pool.model_names)
    rows = {"pretrained": evaluate(pool.load_pretrained_model(), tasks), "experts": {}}
    for task in tasks:
        rows["experts"].update(evaluate(pool.load_model(task), [task]))
    return rows
