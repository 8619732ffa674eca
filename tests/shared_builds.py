"""A folder that tests only read, built once for all pytest-xdist workers of a run.

pytest-xdist's recipe for a fixture that runs once: the first worker to ask builds it under a lock in the folder the
workers share (the parent of each worker's base temporary folder), the others wait and read it. ``--dist loadgroup``
would keep such tests on one worker, but does not group with pytest 9.2 and xdist 3.8 (xdist sets ``item._nodeid``,
which pytest 9.2's ``nodeid`` no longer reads).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

DONE = ".built"


def built_once(tmp_path_factory, worker_id: str, name: str, build: Callable[[Path], object]) -> Path:
    """``build(folder)`` for the run's folder ``name``, unless a worker built it already; the folder. A build that
    failed or was stopped leaves no mark, and the next one starts over."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    folder = shared / name
    with FileLock(f"{folder}.lock"):
        if not (folder / DONE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).touch()
    return folder
