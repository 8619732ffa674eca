"""Every FusionBench method config as an option of the `method/upstream` group, under its own name.

`fusion_bench method=featcal method/upstream=regmean_plusplus/clip_regmean_plusplus ...` composes FusionBench's
`method/regmean_plusplus/clip_regmean_plusplus.yaml` at `method.upstream`, as if it were one of our
`config/method/upstream/*.yaml`. This config source serves the `method/upstream` subtree from FusionBench's `method`
group (read from the installed `fusion_bench_config` package, so a merger FusionBench adds later is there with no
change here) and nothing else. It sits on the search path after our own configs (`featcal_searchpath.py`), so our
short names (task_arithmetic, wudi, ...) win over FusionBench's files of the same name.
"""

from __future__ import annotations

from importlib import resources
from typing import List, Optional

from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult

GROUP = "method/upstream"
SOURCE_GROUP = "method"


def _source_path(config_path: str) -> Optional[str]:
    """``method/upstream/<x>`` -> ``method/<x>``; anything outside the subtree -> None."""
    path = config_path.strip("/")
    if path == GROUP:
        return SOURCE_GROUP
    if path.startswith(GROUP + "/"):
        return SOURCE_GROUP + path[len(GROUP):]
    return None


class UpstreamMethodsConfigSource(ImportlibResourcesConfigSource):
    """``fusion-bench-upstream://<package>``: the package's ``method/`` group served as ``method/upstream/``."""

    @staticmethod
    def scheme() -> str:
        return "fusion-bench-upstream"

    def _read_config(self, res) -> ConfigResult:
        result = super()._read_config(res)
        result.path = f"{self.scheme()}://{self.path}"
        return result

    def load_config(self, config_path: str) -> ConfigResult:
        source = _source_path(config_path)
        if source is None:
            raise ConfigLoadError(f"Config not found : {config_path}")
        return super().load_config(source)

    def is_group(self, config_path: str) -> bool:
        path = config_path.strip("/")
        if path in ("", "method"):  # the parents of the subtree, so that Hydra walks down to it
            return self.available()
        source = _source_path(path)
        return source is not None and super().is_group(source)

    def is_config(self, config_path: str) -> bool:
        source = _source_path(config_path)
        return source is not None and super().is_config(source)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        """Names in a group (a subgroup's name, a config's without ``.yaml``), as Hydra's own sources list them."""
        groups = results_filter in (None, ObjectType.GROUP)
        configs = results_filter in (None, ObjectType.CONFIG)
        path = config_path.strip("/")
        if path in ("", "method"):
            return [("method" if path == "" else "upstream")] if groups and self.available() else []
        source = _source_path(path)
        if source is None or not super().is_group(source):
            return []
        names = set()
        for entry in resources.files(self.path).joinpath(source).iterdir():
            if entry.name in ("__pycache__", "__init__.py"):
                continue
            if entry.is_dir() and groups:
                names.add(entry.name)
            elif entry.is_file() and entry.name.endswith(".yaml") and configs:
                names.add(entry.name[: -len(".yaml")])
        return sorted(names)
