"""FusionBench 0.2.33's RegMean++ for CLIP fails as shipped; our config fix (config_fixes/method/...) names a class that
constructs, for `method=` and `method/upstream=` alike (docs/compatibility.md)."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from test_cli import fusion_bench, toy_args

REPO = Path(__file__).resolve().parents[1]
CONFIG = "regmean_plusplus/clip_regmean_plusplus"
SHIPPED = Path(importlib.util.find_spec("fusion_bench_config").submodule_search_locations[0]) / "method" / f"{CONFIG}.yaml"
FIXED_TARGET = "featcal_fusionbench.integration.fusion_bench_fixes.RegMeanAlgorithmForCLIPPlusPlus"


@pytest.fixture(scope="module")
def method():
    import fusion_bench_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        yield lambda *overrides: OmegaConf.to_container(compose("fabric_model_fusion", overrides=list(overrides)).method)
    GlobalHydra.instance().clear()


def shipped_arguments():
    return {k: v for k, v in yaml.safe_load(SHIPPED.read_text()).items() if k != "_target_"}


def test_fusion_benchs_own_class_still_fails_so_the_fix_is_still_needed():
    """When a FusionBench release repairs the class, this fails: drop the fix (docs/compatibility.md, "To drop")."""
    from fusion_bench.method import RegMeanAlgorithmForCLIPPlusPlus

    with pytest.raises(AttributeError, match="inverse"):
        RegMeanAlgorithmForCLIPPlusPlus(**shipped_arguments())


def test_the_fix_is_fusion_benchs_file_with_its_class_alone_replaced():
    fixed = yaml.safe_load((REPO / "config_fixes" / "method" / f"{CONFIG}.yaml").read_text())
    assert fixed == {**yaml.safe_load(SHIPPED.read_text()), "_target_": FIXED_TARGET}


@pytest.mark.parametrize("choice", [f"method={CONFIG}", f"method/upstream={CONFIG}"])
def test_both_ways_of_naming_it_compose_to_the_fix_and_construct(method, choice):
    from fusion_bench.utils.instantiate_utils import instantiate

    cfg = method(choice) if choice.startswith("method=") else method("method=featcal", choice)["upstream"]
    assert cfg == {**yaml.safe_load(SHIPPED.read_text()), "_target_": FIXED_TARGET}
    merger = instantiate(cfg, _recursive_=False)
    from fusion_bench.method import RegMeanAlgorithmForCLIPPlusPlus

    assert isinstance(merger, RegMeanAlgorithmForCLIPPlusPlus)  # FusionBench's class: its run(), unchanged
    arguments = shipped_arguments()
    assert merger.dataloader_kwargs == arguments.pop("dataloader_kwargs")
    assert {k: getattr(merger, k) for k in arguments} == arguments


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_featcal_runs_after_regmean_plusplus_on_the_toy_world(toy_world, tmp_path):
    fusion_bench(*toy_args(toy_world, "method=featcal", f"method/upstream={CONFIG}",
                           "method.upstream.num_regmean_examples=8", "method.upstream.dataloader_kwargs.batch_size=4",
                           f"path.log_dir={tmp_path}"), cwd=tmp_path)
    assert json.loads((tmp_path / "featcal_report.json").read_text())["upstream"] == f"method:{FIXED_TARGET}"
    assert 0.0 <= json.loads((tmp_path / "program_report.json").read_text())["average"]["accuracy"] <= 1.0
