"""Makes the offline worlds' pools (`modelpool=CLIPVisionModelPool/offline_clip8`, ...) resolve in `fusion_bench`.

Hydra discovers this module in the `hydra_plugins` namespace package. It appends the experiments' configs
(shipped as the `featcal_experiments_config` package) to the search path, and registers the resolvers that those
pool configs use to find a built world.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from featcal_experiments.worlds.resolvers import register_resolvers

register_resolvers()

EXPERIMENT_CONFIGS = "pkg://featcal_experiments_config"


class FeatCalExperimentsSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if EXPERIMENT_CONFIGS not in [element.path for element in search_path.get_path()]:
            search_path.append(provider="featcal-experiments", path=EXPERIMENT_CONFIGS)
