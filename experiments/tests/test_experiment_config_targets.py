"""Every ``_target_`` that an experiments' config names resolves to an object (the product's check,
tests/test_config_targets.py, over experiments/config)."""

import pytest
from hydra.utils import get_object

from test_config_targets import all_targets

TARGETS = all_targets(["experiments/config"])


def test_the_configs_name_targets():
    assert len(TARGETS) > 3 and any(t.startswith("featcal_experiments.") for t in TARGETS)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_resolves(target):
    assert callable(get_object(target)), f"{target} (first named in {TARGETS[target]})"
