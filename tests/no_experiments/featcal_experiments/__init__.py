"""Shadows the experiments' package while the product's tests run (``tests/conftest.py`` puts this folder first on
the import path, in the pytest process and in the processes the tests start): the product's tests must not need
the experiments."""

raise ImportError("featcal_experiments is not available to the product's tests (tests/no_experiments/)")
