"""Where a block's weights are while it is used: moved to the device for the block, then back; a lazy module is
read from its checkpoint onto the device and released after."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import nn

from .lazy import is_lazy, materialize, release


@contextmanager
def on_device(modules: Iterable[nn.Module], device: torch.device):
    """Move modules to ``device`` for the duration of the block, then put them back; a lazy module (a base or
    expert read from its checkpoint, ``lazy_models``) is read onto the device and released after."""
    # Once each: a module listed twice (T5's shared embedding) would otherwise record the device as its origin.
    modules = list({id(m): m for m in modules}.values())
    origins, read = [], []
    try:
        for module in modules:
            if is_lazy(module):
                read.append(module)
                materialize(module, device)
                origins.append(None)
                continue
            first = next(itertools.chain(module.parameters(), module.buffers()), None)
            origins.append(None if first is None else first.device)
            module.to(device)
        yield
    finally:
        for module in read:
            release(module)
        for module, origin in zip(modules, origins):
            if origin is not None:
                module.to(origin)

