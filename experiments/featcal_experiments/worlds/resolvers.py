"""OmegaConf resolvers that let packaged configs point into a built offline world.

``${featcal_world:clip}`` is the world's folder; ``${featcal_world_meta:clip,classnames}`` is an entry of its
``world.json``. Both fail with the command that builds the world when it is absent, so a missing world is reported
when the pool is instantiated, before any model is loaded.
"""

from __future__ import annotations

import json

from omegaconf import OmegaConf


def _built_world(name: str):
    from .registry import is_built, world_path

    if not is_built(name):
        raise FileNotFoundError(
            f"offline world {name!r} is not built (looked in {world_path(name)}); build it with: featcal-world build {name}"
        )
    return world_path(name)


def world_folder(name: str) -> str:
    return str(_built_world(name))


def world_meta(name: str, key: str):
    meta = json.loads((_built_world(name) / "world.json").read_text())
    if key not in meta:
        raise KeyError(f"world {name!r} has no entry {key!r} in world.json; rebuild it with: featcal-world build {name} --force")
    value = meta[key]
    # In-place resolution (FusionBench's CLI calls OmegaConf.resolve) accepts containers only as OmegaConf nodes.
    return OmegaConf.create(value) if isinstance(value, (dict, list)) else value


def register_resolvers() -> None:
    for resolver_name, function in (("featcal_world", world_folder), ("featcal_world_meta", world_meta)):
        if not OmegaConf.has_resolver(resolver_name):
            OmegaConf.register_new_resolver(resolver_name, function)
