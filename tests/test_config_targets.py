"""Every ``_target_`` that a shipped config names resolves to an object (a renamed class or module fails here, not in
a user's run)."""

from pathlib import Path

import pytest
import yaml
from hydra.utils import get_object

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIRS = ["config", "config_fixes"]  # the experiments' own: experiments/tests/test_experiment_config_targets.py
UNSET = "???"  # a mandatory value a composing config fills in (feature_surgery.yaml)


def targets(node, where):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield value, where
            else:
                yield from targets(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{where}[{i}]")


def all_targets(folders=CONFIG_DIRS):
    """target -> where it is first named, over every YAML under ``folders`` (relative to the repository)."""
    found = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.yaml")):
            for target, where in targets(yaml.safe_load(path.read_text()) or {}, path.relative_to(REPO).as_posix()):
                if target != UNSET:
                    found.setdefault(target, where)
    return found


TARGETS = all_targets()


def test_the_configs_name_targets():
    named = {"featcal_fusionbench.FeatCalAlgorithm", "featcal_fusionbench.SurgeryAlgorithm",
             "featcal_fusionbench.evaluation.lm_eval_taskpool.LMEvalTaskPool", "fusion_bench.method.TaskArithmeticAlgorithm"}
    assert len(TARGETS) > 10 and named <= set(TARGETS)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_resolves(target):
    assert callable(get_object(target)), f"{target} (first named in {TARGETS[target]})"
