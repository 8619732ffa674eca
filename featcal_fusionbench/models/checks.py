"""Checks that the models FeatCal combines share one architecture."""

from __future__ import annotations

import logging
from typing import Collection

from torch import nn

log = logging.getLogger(__name__)


def check_same_architecture(reference: nn.Module, model: nn.Module, name: str,
                            shapes_may_differ: Collection[str] = ()) -> None:
    """Raise naming ``name`` when its class, parameter names or shapes differ from the reference; a shape of a key in
    ``shapes_may_differ`` (what the model's family never calibrates) may differ, and is logged."""
    if type(model) is not type(reference):
        raise ValueError(
            f"{name} is a {type(model).__name__}, but the pretrained model is a {type(reference).__name__}"
        )
    ref_state = reference.state_dict()
    state = model.state_dict()
    missing = [k for k in ref_state if k not in state]
    extra = [k for k in state if k not in ref_state]
    if missing or extra:
        raise ValueError(
            f"{name} has different parameters from the pretrained model "
            f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected: {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )
    for key, tensor in ref_state.items():
        if state[key].shape == tensor.shape:
            continue
        if key in shapes_may_differ:
            log.info("%s: %s is %s where the pretrained model has %s; tolerated: it is not calibrated", name, key,
                     tuple(state[key].shape), tuple(tensor.shape))
        else:
            raise ValueError(
                f"{name} has a different shape for {key}: {tuple(state[key].shape)} "
                f"where the pretrained model has {tuple(tensor.shape)}"
            )
