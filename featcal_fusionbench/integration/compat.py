"""Backports that let FusionBench modules written for newer Pythons import on the versions this package supports."""

from __future__ import annotations

import sys
import typing


def backport_typing_override() -> None:
    """Make ``typing.override`` (PEP 698, Python 3.12) available on 3.10 / 3.11 as ``typing_extensions.override``,
    its documented backport: FusionBench 0.2.33's OpenCLIP model pool does ``from typing import override`` and
    cannot be imported otherwise. The decorator only sets ``__override__`` on the function, on either version.
    This adds one attribute to the ``typing`` module of the process; on 3.12 and later nothing is touched."""
    if sys.version_info >= (3, 12) or hasattr(typing, "override"):
        return
    from typing_extensions import override

    typing.override = override
