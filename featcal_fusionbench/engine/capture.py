"""Capture the inputs (and outputs) that a block's calibrated sites receive during one forward."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional

from torch import Tensor

from ..families.sites import Site


@contextmanager
def capture_inputs(sites: Mapping[str, Site], outputs: Optional[Dict[str, Tensor]] = None) -> Iterator[Dict[str, Tensor]]:
    """Yield a dict that fills with each site's input tensor while the block runs; with ``outputs``,
    that dict fills with each site's output too."""
    captured: Dict[str, Tensor] = {}
    handles = []
    for name, site in sites.items():
        on_output = None if outputs is None else (lambda y, _name=name: outputs.__setitem__(_name, y))
        handles += site.hooks(lambda x, _name=name: captured.__setitem__(_name, x), on_output)
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def group_shared_inputs(captured: Mapping[str, Tensor], names: List[str]) -> List[List[str]]:
    """Group sites that received the very same tensor (e.g. q, k and v), in the given order."""
    groups: Dict[int, List[str]] = {}
    for name in names:
        groups.setdefault(id(captured[name]), []).append(name)
    return list(groups.values())
