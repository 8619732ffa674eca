"""FeatCal (Feature Calibration for Post-Merging Models) as a FusionBench method.

The package is nine layers, lowest first; a module imports only its own layer and those below
(``tests/test_layers.py`` keeps the rule):

- ``core``: pure tensor math (moments, a block's sums over tasks, the closed-form solver, the held-out objective,
  meters, the seeded sampling of examples) and the method's hyperparameters;
- ``reports``: what runs left on disk read back and drawn (a sweep's table and picture, a run's drift picture, runs
  side by side: ``featcal-report``), and the leaderboard's cells run, each a ``fusion_bench`` process forked from
  one that imported it once; knowing no model;
- ``models``: where weights live (lazy checkpoints, a block on the device while in use, model checks, the task
  switch that Surgery's maps and the task pools share);
- ``evaluation``: FusionBench task pools and their scorers (lm-eval tasks, the code sandbox), knowing no method;
- ``families``: one module per model family (CLIP, OpenCLIP, T5, decoder-only LMs): the block walk, the calibrated
  sites, token weights;
- ``engine``: the forward-order loop (Algorithm 1): the plan, the hidden-state streams, one block's step (collect a
  task's moments, fold, solve, write) and the policy that gives each block its lambda / rho / alpha;
- ``autoselect``: lambda / rho / alpha chosen without labels (a policy for the engine, and the searches);
- ``integration``: FeatCal in FusionBench and Hydra (the method, the pools' checks, calibration data, the merged
  model's sources, the hub, the results table);
- ``baselines``: Surgery and ProbSurgery, FusionBench methods on the same integration.

docs/architecture.md draws one block's data flow. The methods load on first use (PEP 562), so that importing a light
module of the package (its pool names, its hyperparameter defaults) does not import torch and FusionBench.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "FeatCalAlgorithm": ".integration.algorithm",
    "FeatCalHParams": ".core.hparams",
    "ProbSurgeryAlgorithm": ".baselines",
    "SurgeryAlgorithm": ".baselines",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
