"""The method configs compose offline, each upstream merger is written once (config/method/upstream/) and
reused by FeatCal, Surgery and ProbSurgery, and each default is written once in YAML (the bases)."""

import importlib.util
import inspect
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
METHOD_DIR = REPO / "config" / "method"
METHOD_CONFIGS = sorted(str(p.relative_to(METHOD_DIR).with_suffix("")) for p in METHOD_DIR.rglob("*.yaml"))
UPSTREAMS = sorted(n.split("/", 1)[1] for n in METHOD_CONFIGS if n.startswith("upstream/"))
ABSTRACT = {"feature_surgery"}  # shared keys of surgery and probsurgery, `_target_: ???`
CALIBRATORS = [n for n in METHOD_CONFIGS if not n.startswith("upstream/") and n not in ABSTRACT]
BASES = {"featcal": "featcal", "surgery": "surgery", "probsurgery": "probsurgery"}  # family -> its base config
UPSTREAM_OF_SETTING = {"ta": "task_arithmetic", "simple_average": "simple_average", "adamerging": "adamerging_clip",
                       "wudi": "wudi", "ta_demo": "task_arithmetic"}
TA_ONLY_KEYS = {"scaling_factor"}


@pytest.fixture(scope="module")
def method():
    """name (and extra overrides) -> the composed `method` node, as the fusion_bench CLI composes it, unresolved."""
    import fusion_bench_config

    GlobalHydra.instance().clear()
    cache = {}
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):

        def composed(name, *overrides):
            key = (name, overrides)
            if key not in cache:
                cfg = compose("fabric_model_fusion", overrides=[f"method={name}", *overrides])
                cache[key] = OmegaConf.to_container(cfg.method, resolve=False)
            return cache[key]

        yield composed
    GlobalHydra.instance().clear()


def upstream_setting(name):
    """featcal/clip_wudi -> wudi; featcal/flan_t5_ta -> task_arithmetic; featcal/causal_lm_ta and the MergeBench
    configs -> task_arithmetic_causallm; the bases -> task_arithmetic."""
    if "/" not in name:
        return "task_arithmetic"
    setting = name.split("/", 1)[1]
    if setting.startswith(("causal_lm", "mergebench")):
        return "task_arithmetic_causallm"
    setting = setting.split("_", 1)[1] if setting.startswith(("clip_", "openclip_")) else "ta"  # flan_t5*_ta
    return UPSTREAM_OF_SETTING[setting]


def constructor_parameters(target):
    """Every named argument of the class's own constructors (its and its featcal_fusionbench bases')."""
    import featcal_fusionbench

    cls = getattr(featcal_fusionbench, target.rsplit(".", 1)[1])
    params = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("featcal_fusionbench") and "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self":
                    params[p.name] = p.default
    return params


def test_the_configs_are_the_expected_ones():
    assert UPSTREAMS == ["adamerging_clip", "simple_average", "task_arithmetic", "task_arithmetic_causallm",
                         "ties_merging_causallm", "wudi"]
    for family in ("featcal", "surgery", "probsurgery"):
        assert family in METHOD_CONFIGS
        for setting in ("clip_ta", "clip_simple_average", "clip_adamerging", "clip_wudi", "flan_t5_ta"):
            assert f"{family}/{setting}" in METHOD_CONFIGS
    assert {"featcal/clip_ta_demo", "featcal/flan_t5_large_ta", "featcal/causal_lm_ta", "featcal/mergebench_llama3.2_3b_ta",
            "featcal/mergebench_llama3.1_8b_ta"} <= set(METHOD_CONFIGS)
    # OpenCLIP: every method after TA, Simple Averaging and WUDI; no AdaMerging (it needs the HF CLIP pool)
    assert sorted(n for n in METHOD_CONFIGS if "openclip" in n) == sorted(
        f"{m}/openclip_{s}" for m in ("featcal", "surgery", "probsurgery") for s in ("simple_average", "ta", "wudi"))


@pytest.mark.parametrize("name", CALIBRATORS)
def test_every_method_config_composes_with_its_own_upstream_replaced_not_merged(method, name):
    cfg = method(name)
    target = cfg["_target_"]
    assert target.startswith("featcal_fusionbench.") and target.endswith("Algorithm")
    upstream = cfg["upstream"]
    assert upstream["_target_"].startswith("fusion_bench.method.")
    # exactly the upstream config of its setting: no key of the base's Task Arithmetic left behind
    assert upstream == method(f"upstream/{upstream_setting(name)}")
    if not upstream_setting(name).startswith("task_arithmetic"):
        assert not TA_ONLY_KEYS & set(upstream)
    # every key is a constructor argument
    unknown = set(cfg) - {"_target_"} - set(constructor_parameters(target))
    assert not unknown, f"{name}: not constructor arguments: {sorted(unknown)}"
    assert cfg.get("last_block_patch_token_weight") is None  # moved into family_options; the old flag only warns


@pytest.mark.parametrize("name", UPSTREAMS)
def test_every_upstream_is_a_fusion_bench_method_of_its_own(method, name):
    cfg = method(f"upstream/{name}")
    assert cfg["_target_"].startswith("fusion_bench.method.")
    assert name.startswith(("task_arithmetic", "ties_merging")) == bool(TA_ONLY_KEYS & set(cfg))


def test_an_llm_config_takes_fusion_benchs_ties_which_out_of_core_computes_tensor_by_tensor(method):
    from featcal_fusionbench.integration.out_of_core import lazy_upstream

    cfg = method("featcal/causal_lm_ta", "method/upstream=ties_merging_causallm")
    assert cfg["upstream"] == method("upstream/ties_merging_causallm")
    assert lazy_upstream(cfg["upstream"]) == {"kind": "ties", "scaling_factor": 0.3, "backbone_only": True,
                                              "threshold": 20.0, "merge_func": "sum"}
    # FusionBench's own TIES config for causal LMs has the same values (it also saves the merge and merges it all)
    fusion_bench = method("linear/ties_merging_for_causallm")
    assert {k: fusion_bench[k] for k in ("scaling_factor", "threshold", "remove_keys", "merge_func")} == {
        k: cfg["upstream"][k] for k in ("scaling_factor", "threshold", "remove_keys", "merge_func")}


def test_the_shared_baseline_keys_are_abstract_alone(method):
    assert OmegaConf.is_missing(OmegaConf.create(method("feature_surgery")), "_target_")


def test_featcal_clip_ta_is_featcal(method):
    assert method("featcal/clip_ta") == method("featcal")
    assert method("surgery/clip_ta") == method("surgery")
    assert method("probsurgery/clip_ta") == method("probsurgery")


def test_family_options_default_empty_and_the_demo_weights_the_last_blocks_patch_tokens(method):
    for name in CALIBRATORS:
        if name.startswith("featcal"):
            expected = {"last_block_patch_token_weight": 0.01} if name == "featcal/clip_ta_demo" else {}
            assert method(name)["family_options"] == expected, name
    demo, base = method("featcal/clip_ta_demo"), method("featcal")
    assert {k: v for k, v in demo.items() if base[k] != v} == {
        "rho": 2.2, "alpha": 0.25, "family_options": {"last_block_patch_token_weight": 0.01}}


@pytest.mark.parametrize("name", ["featcal", "featcal/clip_wudi", "surgery/clip_adamerging", "probsurgery/flan_t5_ta"])
@pytest.mark.parametrize("upstream", ["simple_average", "wudi", "task_arithmetic"])
def test_the_upstream_switches_from_the_command_line(method, name, upstream):
    cfg = method(name, f"method/upstream={upstream}")
    assert cfg["upstream"] == method(f"upstream/{upstream}")
    assert {k: v for k, v in cfg.items() if k != "upstream"} == {k: v for k, v in method(name).items() if k != "upstream"}
    assert method(name, f"method/upstream={upstream}", "method.upstream._target_=x.Y")["upstream"]["_target_"] == "x.Y"


FUSION_BENCH_METHODS = Path(importlib.util.find_spec("fusion_bench_config").submodule_search_locations[0]) / "method"


@pytest.mark.parametrize("name", ["featcal", "surgery/clip_ta", "probsurgery/flan_t5_ta"])
@pytest.mark.parametrize("upstream", ["ties_merging", "regmean/clip_regmean",
                                      "isotropic_merging/iso_cts", "singular_value_calibration/task_arithmetic"])
def test_any_fusion_bench_method_config_is_an_upstream_by_its_own_name(method, name, upstream):
    """method/upstream=<the path of a config under FusionBench's method/ group>: its file, as FusionBench ships it,
    at method.upstream, its arguments overridden as any other's; nothing of ours copied."""
    assert not (METHOD_DIR / "upstream" / f"{upstream}.yaml").exists()
    shipped = yaml.safe_load((FUSION_BENCH_METHODS / f"{upstream}.yaml").read_text())
    cfg = method(name, f"method/upstream={upstream}")
    assert cfg["upstream"] == shipped
    assert {k: v for k, v in cfg.items() if k != "upstream"} == {k: v for k, v in method(name).items() if k != "upstream"}
    key = next(k for k in shipped if k != "_target_")
    assert method(name, f"method/upstream={upstream}", f"method.upstream.{key}=7")["upstream"][key] == 7


def test_our_short_upstream_names_win_over_fusion_benchs_files_of_the_same_name(method):
    assert (FUSION_BENCH_METHODS / "task_arithmetic.yaml").is_file()
    assert method("featcal", "method/upstream=task_arithmetic")["upstream"]["inplace"] is False  # ours only


def test_an_upstream_config_with_a_defaults_list_of_its_own_composes(method, tmp_path, monkeypatch):
    """A merger config composed from others: its relative defaults resolve inside the method group as they do when
    FusionBench composes it as `method=my_merger/clip_my_merger` (there method/my_merger/common, here
    method/upstream/my_merger/common, served from the same file)."""
    package = tmp_path / "more_methods"
    (package / "method" / "my_merger").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "method" / "my_merger" / "common.yaml").write_text("scaling_factor: 0.3\nexclude_keys: null\n")
    (package / "method" / "my_merger" / "clip_my_merger.yaml").write_text(
        "defaults:\n  - my_merger/common@_here_\n  - _self_\n_target_: fusion_bench.method.TaskArithmeticAlgorithm\nscaling_factor: 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    upstream = method("featcal", "method/upstream=my_merger/clip_my_merger",
                      "hydra.searchpath=[fusion-bench-upstream://more_methods]")["upstream"]
    assert upstream == {
        "_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.5, "exclude_keys": None}


def test_an_unknown_upstream_lists_fusion_benchs_options_beside_ours(method):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as error:
        method("featcal", "method/upstream=regmean_plus_plus")
    listed = str(error.value)
    assert "ties_merging\n" in listed and "task_arithmetic_causallm" in listed  # FusionBench's file, and ours


def test_each_upstream_and_each_default_is_written_once():
    """No config but method/upstream/* writes an upstream mapping; a config composing from a base states only
    what differs from it (its defaults list, and keys whose value the base does not already have)."""
    for name in METHOD_CONFIGS:
        if name.startswith("upstream/"):
            continue
        own = yaml.safe_load((METHOD_DIR / f"{name}.yaml").read_text()) or {}
        assert "upstream" not in own, f"{name} writes its upstream out: use the method/upstream group"
        if "/" in name:  # a variant: composes from its base and restates none of its values
            family = name.split("/")[0]
            parents = [d for d in own["defaults"] if isinstance(d, str) and d.endswith("@_here_")]
            assert parents and all(p.startswith((f"/method/{BASES[family]}@", f"/method/{family}/")) for p in parents), name


def test_variants_state_only_what_differs_from_their_base(method):
    for name in CALIBRATORS:
        if "/" not in name:
            continue
        own = yaml.safe_load((METHOD_DIR / f"{name}.yaml").read_text()) or {}
        base = {}  # what its parents compose to (`/method/<parent>@_here_` in its defaults), in their order
        for parent in own.get("defaults", []):
            if isinstance(parent, str) and parent.endswith("@_here_"):
                base.update(method(parent[len("/method/"):-len("@_here_")]))
        base = base or method(BASES[name.split("/")[0]])
        restated = {k for k, v in own.items() if k != "defaults" and k in base and base[k] == v}
        assert not restated, f"{name} restates its base's {sorted(restated)}"


@pytest.mark.parametrize("base", ["featcal", "surgery", "probsurgery"])
def test_the_bases_defaults_are_the_constructors(method, base):
    """The YAML bases and the code write the same default for every argument both have."""
    cfg = method(base)
    params = constructor_parameters(cfg["_target_"])
    for key, value in cfg.items():
        if key in ("_target_", "upstream", "family_options") or key not in params:  # family_options: None in code means {}
            continue
        assert params[key] == value and type(params[key]) is type(value), (base, key, params[key], value)
