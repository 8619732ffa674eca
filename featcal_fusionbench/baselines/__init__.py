"""Surgery and ProbSurgery, chained after any upstream merger like FeatCal."""

from .algorithm import FeatureSurgeryAlgorithm, ProbSurgeryAlgorithm, SurgeryAlgorithm
from .modules import ProbSurgeryModelWrapper, SurgeryModelWrapper

__all__ = [
    "FeatureSurgeryAlgorithm",
    "ProbSurgeryAlgorithm",
    "ProbSurgeryModelWrapper",
    "SurgeryAlgorithm",
    "SurgeryModelWrapper",
]
