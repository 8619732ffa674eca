"""Capture the inputs that chosen modules receive during one block forward."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional

from torch import Tensor, nn


def _first_tensor(args, kwargs) -> Tensor:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor):
            return value
    raise RuntimeError("a calibrated module was called without a tensor input")


@contextmanager
def capture_inputs(
    modules: Mapping[str, nn.Module], outputs: Optional[Dict[str, Tensor]] = None
) -> Iterator[Dict[str, Tensor]]:
    """Yield a dict that fills with each module's input tensor while the block runs; with
    ``outputs``, that dict fills with each module's output too."""
    captured: Dict[str, Tensor] = {}
    handles = []
    for name, module in modules.items():

        def hook(_module, args, kwargs, _name=name):
            captured[_name] = _first_tensor(args, kwargs)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        if outputs is not None:

            def out_hook(_module, _args, output, _name=name):
                outputs[_name] = output

            handles.append(module.register_forward_hook(out_hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def group_shared_inputs(captured: Mapping[str, Tensor], names: List[str]) -> List[List[str]]:
    """Group modules that received the very same tensor (e.g. q, k and v), in the given order."""
    groups: Dict[int, List[str]] = {}
    for name in names:
        groups.setdefault(id(captured[name]), []).append(name)
    return list(groups.values())
