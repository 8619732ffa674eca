"""Experiments around featcal-fusionbench: the offline worlds, the paper's tables as commands, diagnostics and
benchmarks. Not imported by the product (``featcal_fusionbench``)."""

from .worlds.resolvers import register_resolvers

# The offline worlds' pool configs point into built worlds through these resolvers.
register_resolvers()
