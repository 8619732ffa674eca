"""FeatCal (Feature Calibration for Post-Merging Models) as a FusionBench method."""

from .algorithm import FeatCalAlgorithm
from .baselines import ProbSurgeryAlgorithm, SurgeryAlgorithm
from .hparams import FeatCalHParams

__version__ = "0.1.0"

__all__ = ["FeatCalAlgorithm", "FeatCalHParams", "ProbSurgeryAlgorithm", "SurgeryAlgorithm", "__version__"]
