"""Reference rows for a world: the pretrained model (zero-shot) on every task and each expert on its own task.

Usage: python scripts/evaluate_references.py WORLD [--json PATH]
Evaluates through FusionBench's CLIP task pool, exactly as the merged models are.
"""

import argparse
import json
import os

import lightning as L
from omegaconf import OmegaConf

from featcal_fusionbench.worlds.registry import get_world, world_path
from fusion_bench.utils import instantiate


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("world")
    parser.add_argument("--json")
    args = parser.parse_args()
    world = get_world(args.world)
    config = world_path(args.world) / "config"
    pool = instantiate(OmegaConf.load(config / "modelpool" / f"{world.modelpool}.yaml"))
    taskpool_cfg = OmegaConf.load(config / "taskpool" / f"{world.taskpool}.yaml")
    fabric = L.Fabric(accelerator="cpu", devices=1)

    def evaluate(model, tasks):
        cfg = taskpool_cfg.copy()
        cfg.test_datasets = {t: cfg.test_datasets[t] for t in tasks}
        cfg.classnames = {t: cfg.classnames[t] for t in tasks}
        taskpool = instantiate(cfg)
        taskpool._fabric_instance = fabric
        report = taskpool.evaluate(model)
        return {t: report[t]["accuracy"] for t in tasks}

    tasks = list(pool.model_names)
    rows = {"pretrained": evaluate(pool.load_pretrained_model(), tasks), "experts": {}}
    for task in tasks:
        rows["experts"].update(evaluate(pool.load_model(task), [task]))
    for name, accs in (("pretrained (zero-shot)", rows["pretrained"]), ("expert on its own task", rows["experts"])):
        avg = sum(accs.values()) / len(accs)
        print(f"{name:24s} " + " ".join(f"{t}={100 * a:.1f}" for t, a in accs.items()) + f" average={100 * avg:.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
