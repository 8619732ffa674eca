"""Makes `fusion_bench method=featcal ...` resolve after `pip install`, with no extra flag.

Hydra discovers this module in the `hydra_plugins` namespace package. It appends
this project's configs (shipped as the `featcal_fusionbench_config` package) to
the search path, after FusionBench's own so theirs win any name clash. When the
FusionBench CLI picked a `./config` folder of the current directory as its primary
config path (as it does from this repository's root), FusionBench's configs are not
on the path at all; they are appended too, so `fabric_model_fusion` still resolves.

One folder goes ahead of FusionBench's instead: `featcal_fusionbench_config_fixes`, copies of
FusionBench configs that name hub ids the hub has renamed, of its `path` config with a log
folder of its own for each job of a multirun, and of its RegMean++ config naming a class that
constructs (docs/compatibility.md, "FusionBench configs we override"). It holds nothing else,
so that dropping it is all it takes once FusionBench releases the fixes. Importing this module
registers the resolver that `path` config names.

Last on the path: every FusionBench method config as an option of `method/upstream`, under its own name
(`upstream_methods.py`), so `method/upstream=regmean_plusplus/clip_regmean_plusplus` chains FeatCal after it;
the fixed method configs are served there too, ahead of FusionBench's.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from .sweep_log_dir import register

register()

FEATCAL_CONFIGS = "pkg://featcal_fusionbench_config"
FEATCAL_CONFIG_FIXES = "pkg://featcal_fusionbench_config_fixes"
FUSION_BENCH_CONFIGS = "pkg://fusion_bench_config"
# FusionBench's method configs as options of method/upstream (upstream_methods.py), after ours
FUSION_BENCH_UPSTREAMS = "fusion-bench-upstream://fusion_bench_config"
FIXED_UPSTREAMS = "fusion-bench-upstream://featcal_fusionbench_config_fixes"


class FeatCalSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        paths = [element.path for element in search_path.get_path()]
        if not any(p is not None and p.rstrip("/").endswith("fusion_bench_config") for p in paths):
            search_path.append(provider="fusion_bench", path=FUSION_BENCH_CONFIGS)
        if FEATCAL_CONFIGS not in paths:
            search_path.append(provider="featcal-fusionbench", path=FEATCAL_CONFIGS)
        for upstreams in (FIXED_UPSTREAMS, FUSION_BENCH_UPSTREAMS):
            if upstreams not in paths:
                search_path.append(provider="fusion-bench-upstream", path=upstreams)
        if FEATCAL_CONFIG_FIXES not in paths:
            search_path.prepend(provider="featcal-fusionbench-fixes", path=FEATCAL_CONFIG_FIXES)
