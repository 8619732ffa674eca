"""Builders of offline worlds: models, data and FusionBench configs made without the hub."""
