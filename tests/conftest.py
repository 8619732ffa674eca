import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory):
    """A toy CLIP world on disk (two tasks), with FusionBench pool and task-pool YAMLs."""
    from featcal_fusionbench.worlds.toy_clip import ToyCLIPSpec, build_toy_clip_world

    root = tmp_path_factory.mktemp("toy_world")
    paths = build_toy_clip_world(root, ToyCLIPSpec(num_tasks=2))
    return {"root": root, **paths}
