"""FeatCal (Feature Calibration for Post-Merging Models) as a FusionBench method.

The methods load on first use (PEP 562), so that importing a light module of the package (its pool names, its
hyperparameter defaults) does not import torch and FusionBench.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "FeatCalAlgorithm": ".algorithm",
    "FeatCalHParams": ".hparams",
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
