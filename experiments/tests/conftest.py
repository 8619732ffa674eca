import os
import sys
from pathlib import Path

# The experiments' tests reuse the product's test helpers (tiny models, the config-target walk).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread per pytest-xdist worker: the workers share the cores
    import torch

    torch.set_num_threads(1)
