"""The paper's tables as commands (experiments/scripts/reproduce.py): every listed command composes offline with no download,
the runner resumes and reuses upstream merged models, the renderer writes paper / ours / diff."""

import copy
import importlib.util
import json
import socket
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from featcal_experiments.reproduce.catalog import (
    CALIBRATORS,
    HUB_SETTINGS,
    SEQ2SEQ_SAVING_POOL,
    TABLES,
    Catalog,
    CatalogError,
    OFFLINE_SETTINGS,
    list_lines,
    parse_tables,
    world_unavailable,
)
from featcal_experiments.reproduce.paper import PAPER
from featcal_experiments.reproduce.render import build_table, csv_text, latex, markdown, scores, write_tables
from featcal_experiments.reproduce.runner import Runner, collect, load_result, world_build

import commands  # tests/commands.py (conftest puts tests/ on the path)

REPO = Path(__file__).resolve().parents[2]
PAPER_MD = Path("/work/shared/paper/featcal-paper.md")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def all_runs(catalog):
    runs = {}
    for table in TABLES:
        for row in catalog.rows(table):
            for run in row.runs:
                runs.setdefault(run.id, run)
    return runs


def overrides_of(run):
    return dict(a.split("=", 1) for a in run.args if "=" in a and not a.startswith("~"))


# -- the catalog -------------------------------------------------------------------------------------------------

def test_every_printed_row_of_every_table_is_in_the_catalog(tmp_path):
    catalog = Catalog("hub", tmp_path)
    assert set(TABLES) == set(PAPER) | {"1-openclip", "12-llm"}  # ours: OpenCLIP models, the LLM world's budget
    assert all(r.skip and "offline LLM world" in r.skip and not r.runs for r in catalog.rows("12-llm"))
    for table in PAPER:
        rows = catalog.rows(table)
        assert {r.paper_key for r in rows} == set(PAPER[table]["rows"]), table
        assert len({r.id for r in rows}) == len(rows)
        assert [r.id for r in rows if r.skip] == (["mtl"] if table in ("1", "7") else [])
    # Table 1's rows on the OpenCLIP task-vector checkpoints: no paper numbers, no AdaMerging on an OpenCLIP pool
    openclip = catalog.rows("1-openclip")
    assert [r.method for r in openclip] == [m for m in TABLES["1"].methods if m != "mtl"]
    assert all(r.paper_key is None and r.setting == "openclip-b32-8" for r in openclip)
    assert [r.id for r in openclip if r.skip] == ["adamerging", *(f"adamerging+{c}" for c in CALIBRATORS)]
    assert all("HF CLIP pool only" in r.skip and not r.runs for r in openclip if r.skip)
    # the paper's per-task columns are the settings' FusionBench task names
    for table, setting in (("1", "b32-8"), ("7", "l14-8"), ("8", "b32-14"), ("9", "l14-14"), ("10", "b32-20"),
                           ("11", "l14-20")):
        assert PAPER[table]["columns"] == [*HUB_SETTINGS[setting].tasks, "average"]
    assert PAPER["3"]["columns"] == [*HUB_SETTINGS["t5-base"].tasks, "average"]
    # Table 2's averages are App. I's
    app_i = {k: v for n in ("7", "8", "9", "10", "11") for k, v in PAPER[n]["rows"].items()}
    assert all(app_i[k]["average"] == v["average"] for k, v in PAPER["2"]["rows"].items())
    # a few cells as printed
    assert PAPER["1"]["rows"]["b32-8/wudi+featcal"]["average"] == 88.8
    assert PAPER["1"]["rows"]["b32-8/simple_average+surgery"]["eurosat"] == 94.7  # printed with a truncated arrow
    assert PAPER["3"]["rows"]["t5-large/ta+featcal"]["glue-stsb"] == 90.8
    assert PAPER["9"]["rows"]["l14-14/simple_average"]["eurosat"] == 80.4  # the row printed with a blank cell
    assert PAPER["2"]["rows"]["l14-20/wudi+featcal"] == {"average": 89.8}


@pytest.mark.skipif(not PAPER_MD.is_file(), reason="the paper's Markdown is not on this machine")
def test_the_paper_numbers_module_is_what_the_extractor_reads_from_the_paper():
    extractor = load_script("extract_paper_numbers")
    assert extractor.extract(PAPER_MD.read_text()) == PAPER


def test_table_4s_paper_columns_are_the_product_task_pools_tasks_in_order():
    path = REPO / "config" / "taskpool" / "LMEvalHarnessTaskPool" / "mergebench_table4.yaml"
    assert list(yaml.safe_load(path.read_text())["tasks"]) == [c for c in PAPER["4"]["columns"] if c != "average"]


def test_offline_world_maps_table_1_and_table_3_base_and_skips_the_rest_with_a_reason(tmp_path):
    catalog = Catalog("offline", tmp_path)
    for row in catalog.rows("1"):
        assert row.setting == "offline-clip8"
        assert bool(row.skip) == (row.method == "mtl")
    # Table 1's OpenCLIP rows: the same world served as OpenCLIP models, the same tasks, run folders apart
    for row in catalog.rows("1-openclip"):
        assert row.setting == "offline-openclip8" and bool(row.skip) == row.method.startswith("adamerging")
    assert catalog.tasks("offline-openclip8") == catalog.tasks("offline-clip8")
    for table in ("2", "7", "8", "9", "10", "11"):
        assert all(r.skip and "no offline" in r.skip and not r.runs for r in catalog.rows(table))
    for row in catalog.rows("3"):
        if row.group == "large":
            assert "FLAN-T5-large" in row.skip
        else:
            assert row.setting == "offline-t5"
    lines = list_lines(catalog.rows("7"))
    assert lines and all(line.startswith("# table 7 ") and "skipped (no offline" in line for line in lines)


def test_the_offline_llm_world_is_table_4s_3b_block_and_its_own_sample_budget_table(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    catalog = Catalog("offline", tmp_path / "runs")
    rows = catalog.rows("4")
    assert all("Llama-3.1-8B" in r.skip for r in rows if r.group == "llama3.1-8b")
    mine = [r for r in rows if r.group == "llama3.2-3b"]
    assert [r.method for r in mine] == ["pretrained", "finetuned", "ta", "ta+surgery", "ta+probsurgery", "ta+featcal"]
    assert all(r.setting == "offline-llm" and not r.skip for r in mine)
    (finetuned,) = [r for r in mine if r.method == "finetuned"]
    assert {r.task: r.provides for r in finetuned.runs} == {
        "math": ("llm_math",), "code": ("llm_code",), "instruction": ("llm_instruction",)}
    budget = {run.id: run for row in catalog.rows("12-llm") for run in row.runs}
    assert len(budget) == 3 * 3 * 3 and {run.budget for run in budget.values()} == {
        (n, s) for n in (8, 32, 128) for s in (42, 43, 44)}
    # Table 4's calibrator rows are the budget table's n = 32, seed 42 runs: one run each, not two
    for row in mine[3:]:
        (run,) = row.runs
        assert run.id == f"offline-llm/{row.method}/n32-seed42" and run.command == budget[run.id].command
    # the world's pool configs live in its own folder: every command adds it to Hydra's search path
    search = f"hydra.searchpath=[file://{tmp_path / 'worlds' / 'llm' / 'config'}]"
    assert all(search in run.args for row in mine for run in row.runs)
    assert not any(a.startswith("hydra.searchpath") for a in catalog.upstream_run("offline-clip8", "ta").args)


def test_an_unbuilt_offline_world_is_named_with_its_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path))
    setting = OFFLINE_SETTINGS["offline-t5"]
    assert world_unavailable(setting) == "the offline world 't5' is not built: run `featcal-world build t5`"
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "world.json").write_text("{}")
    assert world_unavailable(setting) is None
    assert world_unavailable(HUB_SETTINGS["t5-base"]) is None


def test_one_task_text_pools_keep_only_that_tasks_regression_entry(tmp_path):
    from featcal_experiments.worlds.text_sources import REGRESSION_TASKS

    assert OFFLINE_SETTINGS["offline-t5"].regression_tasks == tuple(REGRESSION_TASKS)
    glue = yaml.safe_load((REPO / "config/taskpool/flan-t5_glue_text_generation_average.yaml").read_text())
    assert HUB_SETTINGS["t5-base"].regression_tasks == tuple(glue["regression_tasks"])
    for world, key in (("hub", "t5-base"), ("offline", "offline-t5")):
        rows = [r for r in Catalog(world, tmp_path).rows("3") if r.setting == key and r.method == "finetuned"]
        for run in rows[0].runs:
            expected = run.task if run.task in HUB_SETTINGS["t5-base"].regression_tasks + ("wordcount",) else ""
            assert f"taskpool.regression_tasks=[{expected}]" in run.args


def test_commands_are_complete_and_calibrators_read_the_saved_upstream_model(tmp_path):
    catalog = Catalog("hub", tmp_path)
    runs = all_runs(catalog)
    # Table 2's runs are App. I's; Table 12 reads Table 1's TA; Table 4: per model the base, 3 experts, TA and 3
    # calibrators (its fine-tuned row reads the base's run for ARC-C, which no expert was trained for)
    assert len(runs) == 25 + 25 + 31 + 31 + 37 + 37 + 26 + 63 + 2 * 8 + 21  # and Table 1's rows on OpenCLIP
    for run in runs.values():
        args = overrides_of(run)
        assert run.command.startswith("fusion_bench method=")
        assert args["path.log_dir"] == str(tmp_path.resolve() / run.id)
        if run.kind == "upstream":
            assert args["merged_model_save_path"] == str(tmp_path.resolve() / run.id / "merged")
        if run.kind == "calibrator":
            upstream = runs[run.depends[0]]
            assert args["method.merged_model_path"] == overrides_of(upstream)["merged_model_save_path"]
    lines = list_lines(Catalog("hub", tmp_path).rows("1"))
    assert len(lines) == 26 and sum(line.startswith("fusion_bench ") for line in lines) == 25

    # CALIBRATOR:KEY=VALUE reaches that calibrator's runs only; a bare override reaches every calibrator
    scoped = Catalog("offline", tmp_path, ["surgery:method.precompute_features=true", "seed=7"])
    for calibrator in CALIBRATORS:
        args = overrides_of(scoped.calibrator_run("offline-t5", "ta", calibrator))
        assert args.get("method.precompute_features") == ("true" if calibrator == "surgery" else None)
        assert args["seed"] == "7"
    assert "seed" not in overrides_of(scoped.upstream_run("offline-t5", "ta"))


@pytest.mark.parametrize("world, key", [("hub", "b32-8"), ("offline", "offline-clip8")])
def test_table_12_runs_each_calibrator_per_budget_and_seed_after_table_1s_task_arithmetic(tmp_path, world, key):
    catalog = Catalog(world, tmp_path, ["method.num_calibration_examples=3", "featcal:method.seed=1"])
    rows = catalog.rows("12")
    assert [r.method for r in rows] == ["ta+surgery", "ta+probsurgery", "ta+featcal"]
    assert PAPER["12"]["std"]["b32-8/ta+featcal"]["n8"] == 0.3 and PAPER["12"]["rows"]["b32-8/ta+featcal"]["n512"] == 85.5
    table_1_ta = catalog.upstream_run(key, "ta")
    for row in rows:
        assert row.setting == key and len(row.runs) == 7 * 3
        assert [r.budget for r in row.runs[:4]] == [(8, 42), (8, 43), (8, 44), (16, 42)]
        for run in row.runs:
            n, seed = run.budget
            assert run.id == f"{key}/{row.method}/n{n}-seed{seed}" and run.depends == (table_1_ta.id,)
            # the budget comes last, so a user's override of n or of the seed cannot change what the cell means
            args = overrides_of(run)
            assert (args["method.num_calibration_examples"], args["method.seed"]) == (str(n), str(seed))
    chosen = catalog.select(["12"], ["ta+featcal/n8-*", "ta+surgery/n512-seed44"])
    assert [[r.part for r in row.runs] for row in chosen] == [["n512-seed44"], ["n8-seed42", "n8-seed43", "n8-seed44"]]
    assert Runner(catalog).plan(chosen)[0].id == table_1_ta.id


def test_bad_input_fails_before_anything_runs(tmp_path):
    assert parse_tables(["I"]) == ["7", "8", "9", "10", "11"]
    assert parse_tables(["1,3", "1"]) == ["1", "3"]
    with pytest.raises(CatalogError, match="unknown table '5'"):
        parse_tables(["5"])
    catalog = Catalog("hub", tmp_path)
    with pytest.raises(CatalogError, match="no row matches 'nope'"):
        catalog.select(["1"], ["ta", "nope"])
    with pytest.raises(CatalogError, match="KEY=VALUE"):
        Catalog("hub", tmp_path, ["method.lambda_"])
    with pytest.raises(CatalogError, match="names one of surgery, probsurgery, featcal"):
        Catalog("hub", tmp_path, ["tsurgery:method.lr=1"])
    with pytest.raises(CatalogError, match="calibrator overrides only"):
        Catalog("hub", tmp_path, all_overrides=["surgery:seed=1"])
    with pytest.raises(CatalogError, match="unknown world"):
        Catalog("mars", tmp_path)
    chosen = catalog.select(["1", "2"], ["ta+featcal", "finetuned/mnist", "l14-20/*"])
    assert [r.id for r in chosen][:2] == ["finetuned", "ta+featcal"]
    assert [run.task for run in chosen[0].runs] == ["mnist"]
    table2 = [r.id for r in chosen[2:]]  # a method name matches it in every block; l14-20/* the whole block
    assert all(r.table == "2" for r in chosen[2:]) and len(table2) == 4 + 10
    assert {i for i in table2 if not i.startswith("l14-20/")} == {f"{k}/ta+featcal" for k in ("l14-8", "b32-14", "l14-14", "b32-20")}

    script = load_script("reproduce")
    for argv, message in ((["--table", "5", "--list"], "unknown table"),
                          (["--table", "1", "--rows", "nope", "--list"], "no row matches")):
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        assert exit_info.value.code == 2
    assert not (tmp_path / "b32-8").exists()


def test_list_prints_one_command_per_line(tmp_path, capsys):
    script = load_script("reproduce")
    assert script.main(["--table", "3", "--list", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 26 and all(line.startswith("fusion_bench ") for line in lines)
    assert any("method=featcal/flan_t5_large_ta" in line for line in lines)
    assert not list(tmp_path.iterdir())  # listing writes nothing


# -- every command composes offline, no download -----------------------------------------------------------------

GROUPS = ("method", "modelpool", "taskpool")


class Composer:
    """Composes a command as Hydra does, fast: its config-group choices (``method=``, ``modelpool=``,
    ``taskpool=``) are each composed by Hydra once per distinct choice, and its value overrides (``key=value``,
    ``~key``) are parsed by Hydra's override parser and applied by Hydra's own ``_apply_overrides_to_config``
    (what ``compose`` does after the defaults list), so every override of every command meets Hydra's checks
    (the key exists, the value parses). ``full`` composes a whole command the plain way."""

    def __init__(self):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.parser = OverridesParser.create()
        self.parts = {}
        self.root = compose("fabric_model_fusion")

    def _part(self, group, choice, search=()):
        if (choice, search) not in self.parts:
            overrides = [*search, f"+{choice}", "+fast_dev_run=false"]
            self.parts[choice, search] = compose(None, overrides=overrides)[group]
        return self.parts[choice, search]

    def __call__(self, run):
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from omegaconf import open_dict

        cfg = copy.deepcopy(self.root)
        search = tuple(a for a in run.args if a.startswith("hydra.searchpath="))  # the LLM world's own configs
        values = []
        for arg in run.args:
            key = arg.lstrip("~+").split("=", 1)[0]
            if key in GROUPS:
                with open_dict(cfg):
                    cfg[key] = self._part(key, arg, search)
            elif key != "hydra.searchpath":
                values.append(arg)
        ConfigLoaderImpl._apply_overrides_to_config(self.parser.parse_overrides(values), cfg)
        return cfg

    def full(self, run):
        return compose("fabric_model_fusion", overrides=list(run.args))


@pytest.fixture(scope="module")
def composer(tmp_path_factory):
    import fusion_bench_config

    from featcal_experiments.worlds.llm_world import LLM_WORLD, write_configs

    mp = pytest.MonkeyPatch()
    for key, value in commands.OFFLINE.items():
        mp.setenv(key, value)
    # the LLM world's pool configs, as its build writes them (composing reads no model or data)
    worlds = tmp_path_factory.mktemp("worlds")
    write_configs(worlds / "llm", LLM_WORLD)
    mp.setenv("FEATCAL_WORLDS_DIR", str(worlds))

    def no_network(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    mp.setattr(socket.socket, "connect", no_network)
    mp.setattr(socket, "create_connection", no_network)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        yield Composer()
    GlobalHydra.instance().clear()
    mp.undo()


def check_composed(cfg, run, catalog, upstream_saves):
    world = catalog.world
    assert cfg.path.log_dir == str(catalog.run_dir(run.id))
    setting = catalog.settings[run.setting]
    tasks, _ = catalog.tasks(run.setting)
    method = OmegaConf.to_container(cfg.method, resolve=True)
    # CLIP's and the text task pools list test_datasets; the lm-eval task pool (Table 4) its tasks
    test_tasks = list(cfg.taskpool.test_datasets if "test_datasets" in cfg.taskpool else cfg.taskpool.tasks)
    if run.kind == "upstream":
        upstream_saves[run.id] = cfg.merged_model_save_path
        assert cfg.merged_model_save_path == str(catalog.run_dir(run.id) / "merged")
        if run.method == "adamerging":
            assert method["name"] == "clip_layer_wise_adamerging"
            assert method["save_merging_weights"] == str(catalog.run_dir(run.id) / "merging_weights.pt")
        else:
            assert method["_target_"].startswith("fusion_bench.method.")
        if setting.family == "t5":
            assert cfg.modelpool._target_ == SEQ2SEQ_SAVING_POOL
    elif run.kind == "calibrator":
        assert method["_target_"].startswith("featcal_fusionbench.")
        assert method["merged_model_path"] == upstream_saves[run.depends[0]]
        if run.calibrator == "featcal" and setting.family in ("clip", "openclip"):
            assert (method["lambda_"], method["rho"], method["alpha"]) == (0.05, 2.0, 0.3)
        if world == "offline" and setting.family == "t5":
            assert method["calibration_datasets"] is None
        if run.calibrator == "featcal" and setting.family == "causal_lm":  # Sec. 5.1's LLM values
            lambda_ = {"llama3.2-3b": 1e-5, "llama3.1-8b": 3.0, "offline-llm": 1e-5}[run.setting]
            assert (method["lambda_"], method["rho"], method["alpha"]) == (lambda_, 0.5, 0.15)
            assert method["upstream"]["merge_backbone"] and method["upstream"]["scaling_factor"] == 0.3
            if world == "hub":  # MergeBench's data; the offline world's pool has its own train_datasets
                assert set(method["calibration_datasets"]) >= {"math", "coding", "instruction"}
            else:
                assert method.get("calibration_datasets") is None and set(cfg.modelpool.train_datasets) == {
                    "math", "code", "instruction"}
    elif run.method == "finetuned":
        assert test_tasks == list(run.provides)
        assert cfg.modelpool.models._get_node("_pretrained_")._value() == f"${{.{run.task}}}"
        if world == "hub":  # the expert's own pool entry, resolved (a hub name or its LoRA config)
            models = OmegaConf.to_container(cfg.modelpool.models, resolve=True)
            assert models["_pretrained_"] == models[run.task]
            # (the task-vector checkpoints' folders are named otherwise: Cars for stanford-cars)
            assert (run.task in json.dumps(models[run.task]) if setting.family != "openclip"
                    else "finetuned.pt" in models[run.task]["pickle_path"])
    else:
        assert method["_target_"] == "fusion_bench.method.DummyAlgorithm"
    if run.method != "finetuned":
        assert test_tasks == list(tasks)
        experts = [m for m in cfg.modelpool.models if not m.startswith("_")]
        if setting.task_experts:  # MergeBench: one expert per domain, several tasks per domain
            assert set(experts) == {e for e in setting.task_experts.values() if e}
        else:
            assert experts == list(tasks)
    if setting.family == "causal_lm" and run.kind == "upstream":
        assert method["_target_"] == "fusion_bench.method.TaskArithmeticForCausalLM" and method["merge_backbone"]
    if world == "hub" and setting.family == "clip":
        arch = "large-patch14" if run.setting.startswith("l14") else "base-patch32"
        assert cfg.taskpool.base_model == f"openai/clip-vit-{arch}"
        assert f"openai/clip-vit-{arch}" in json.dumps(OmegaConf.to_container(cfg.modelpool, resolve=True)["processor"])
    if setting.family == "openclip":  # our OpenCLIP pools: QuickGELU encoders, the task set per dataset
        assert cfg.modelpool._target_ == "featcal_fusionbench.integration.openclip_pools.OpenCLIPPool"
        assert cfg.taskpool._target_ == "featcal_fusionbench.integration.openclip_pools.OpenCLIPTaskPool"
        assert list(cfg.taskpool.classification_heads) == list(tasks)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["hub", "offline"])
def test_every_listed_command_composes_with_the_hub_unreachable(composer, tmp_path, world):
    from fusion_bench.modelpool import Seq2SeqLMPool

    from featcal_experiments.reproduce.pools import Seq2SeqLMPoolSavingPretrained

    assert issubclass(Seq2SeqLMPoolSavingPretrained, Seq2SeqLMPool)
    assert SEQ2SEQ_SAVING_POOL == f"{Seq2SeqLMPoolSavingPretrained.__module__}.Seq2SeqLMPoolSavingPretrained"
    catalog = Catalog(world, tmp_path)
    runs = all_runs(catalog)
    assert len(runs) >= (212 if world == "hub" else 25)
    upstream_saves = {}
    for run in runs.values():
        check_composed(composer(run), run, catalog, upstream_saves)
    # the plain way, one command per setting and kind of run: the same config as the fast way
    representatives = {}
    for run in runs.values():
        representatives.setdefault((run.setting, run.kind), run)
    for run in representatives.values():
        full = composer.full(run)
        check_composed(full, run, catalog, upstream_saves)
        full, fast = (OmegaConf.to_container(c) for c in (full, composer(run)))
        full.pop("hydra", None), fast.pop("hydra", None)
        assert full == fast, run.id


def test_the_fast_composer_rejects_what_hydra_rejects(composer, tmp_path):
    from dataclasses import replace

    run = Catalog("hub", tmp_path).calibrator_run("b32-8", "ta", "featcal")
    bad_key = replace(run, args=(*run.args, "method.no_such_option=1"))
    bad_group = replace(run, args=tuple("taskpool=CLIPVisionModelTaskPool/no_such_pool" if a.startswith("taskpool=")
                                        else a for a in run.args))
    bad_delete = replace(run, args=(*run.args, "~taskpool.test_datasets.no_such_task"))
    for bad, message in ((bad_key, "no_such_option"), (bad_group, "no_such_pool"), (bad_delete, "no_such_task")):
        for compose_ in (composer, composer.full):
            with pytest.raises(Exception, match=message):
                compose_(bad)


@pytest.mark.slow
def test_two_commands_compose_through_the_cli_with_cfg_job(tmp_path):
    catalog = Catalog("hub", tmp_path)
    picks = [catalog.select(["11"], ["adamerging+probsurgery"])[0].runs[0],
             catalog.select(["3"], ["large/finetuned/glue-cola"])[0].runs[0],
             catalog.select(["4"], ["llama3.1-8b/ta+featcal"])[0].runs[0]]
    done = [commands.run("fusion_bench", *run.args, "--cfg", "job", cwd=tmp_path, timeout=300) for run in picks]
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [proc.stdout for proc in done]
    assert f"merged_model_path: {tmp_path.resolve()}/l14-20/adamerging/merged" in outputs[0]
    assert "base_model: openai/clip-vit-large-patch14" in outputs[0]
    assert "_pretrained_: ${.glue-cola}" in outputs[1]
    assert "lambda_: 3.0" in outputs[2] and "_target_: featcal_fusionbench.evaluation.lm_eval_taskpool.LMEvalTaskPool" in outputs[2]
    assert not any(p.name != "outputs" for p in tmp_path.iterdir())  # nothing run, no run folder made


def test_the_seq2seq_pool_saves_what_merged_model_path_loads(tmp_path):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from featcal_experiments.reproduce.pools import Seq2SeqLMPoolSavingPretrained

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=2, decoder_start_token_id=0))
    pool = Seq2SeqLMPoolSavingPretrained(models={"_pretrained_": "unused"}, tokenizer=None)
    pool.save_model(model, str(tmp_path / "merged"))
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path / "merged")  # what FeatCal's loader calls
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


# -- the runner ----------------------------------------------------------------------------------------------------

def fake_executor(calls, fail=()):
    """Writes what FusionBench would: the report in path.log_dir, the merged model, AdaMerging's weights."""

    def execute(args, run_dir, log_path, env):
        calls.append(str(run_dir))
        values = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("~"))
        assert Path(values["path.log_dir"]) == run_dir
        log_path.write_text("log\n")
        if any(str(run_dir).endswith(f) for f in fail):
            return 1
        if "merged_model_save_path" in values:
            merged = Path(values["merged_model_save_path"])
            merged.mkdir(parents=True, exist_ok=True)
            (merged / "config.json").write_text("{}")
        if "method.save_merging_weights" in values:
            Path(values["method.save_merging_weights"]).write_bytes(b"weights")
        (run_dir / "program_report.json").write_text(json.dumps({"mnist": {"accuracy": 0.5}, "average": {"accuracy": 0.5}}))
        return 0

    return execute


def test_runner_saves_each_upstream_once_resumes_and_reruns_what_changed(tmp_path):
    calls = []
    catalog = Catalog("hub", tmp_path)
    rows = catalog.select(["1"], ["ta+*", "adamerging+featcal"])
    runner = Runner(catalog, fake_executor(calls), log=lambda _: None)
    assert [r.id for r in runner.plan(rows)] == [
        "b32-8/ta", "b32-8/ta+surgery", "b32-8/ta+probsurgery", "b32-8/ta+featcal", "b32-8/adamerging",
        "b32-8/adamerging+featcal"]
    summary = runner.run(rows)
    assert summary.ok and summary.count("ran") == 6
    assert calls.count(str(catalog.run_dir("b32-8/ta"))) == 1  # the upstream ran once, before its calibrators
    assert calls.index(str(catalog.run_dir("b32-8/ta"))) == 0
    assert (catalog.run_dir("b32-8/adamerging") / "merging_weights.pt").is_file()
    result = load_result(catalog.run_dir("b32-8/ta+featcal"))
    assert result["command"] == catalog.calibrator_run("b32-8", "ta", "featcal").command
    assert result["depends_on"] == {"b32-8/ta": load_result(catalog.run_dir("b32-8/ta"))["stamp"]}
    assert not list(tmp_path.rglob(".*.tmp-*"))  # written atomically

    calls.clear()  # everything has a report from the same command: nothing runs
    summary = runner.run(rows)
    assert calls == [] and summary.count("resumed") == 6

    # a partially written run (report, no result) runs again, alone
    (catalog.run_dir("b32-8/ta+surgery") / "result.json").unlink()
    runner.run(rows)
    assert calls == [str(catalog.run_dir("b32-8/ta+surgery"))]

    # changed calibrator commands rerun the calibrators, not the upstream mergers
    calls.clear()
    catalog16 = Catalog("hub", tmp_path, ["method.num_calibration_examples=16"])
    summary = Runner(catalog16, fake_executor(calls), log=lambda _: None).run(catalog16.select(["1"], ["ta+*"]))
    assert sorted(calls) == sorted(str(catalog.run_dir(f"b32-8/ta+{c}")) for c in CALIBRATORS)
    assert summary.count("resumed") == 1

    # an upstream made again (its result lost) reruns every calibrator that read it, commands unchanged
    calls.clear()
    (catalog.run_dir("b32-8/ta") / "result.json").unlink()
    runner.run(catalog.select(["1"], ["ta+*"]))
    assert calls[0] == str(catalog.run_dir("b32-8/ta")) and len(calls) == 4


def test_runner_does_not_run_calibrators_of_a_failed_upstream(tmp_path):
    calls = []
    catalog = Catalog("hub", tmp_path)
    summary = Runner(catalog, fake_executor(calls, fail=("b32-8/wudi",)), log=lambda _: None).run(
        catalog.select(["1"], ["wudi", "wudi+featcal", "pretrained"]))
    statuses = {o.run.id: o.status for o in summary.outcomes}
    assert statuses == {"b32-8/pretrained": "ran", "b32-8/wudi": "failed", "b32-8/wudi+featcal": "skipped"}
    assert not summary.ok and "run.log" in summary.text()
    assert calls == [str(catalog.run_dir("b32-8/pretrained")), str(catalog.run_dir("b32-8/wudi"))]
    assert load_result(catalog.run_dir("b32-8/wudi")) is None


def test_a_rebuilt_offline_world_reruns_its_runs_and_hides_the_old_builds_results(tmp_path, monkeypatch):
    # A rebuild keeps the world's paths, so the commands are unchanged: only world.json's fingerprint tells.
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    (tmp_path / "worlds" / "clip").mkdir(parents=True)
    (tmp_path / "worlds" / "clip" / "world.json").write_text('{"build": 1}')
    calls = []
    catalog = Catalog("offline", tmp_path / "runs")
    rows = catalog.select(["1"], ["ta"])
    runner = Runner(catalog, fake_executor(calls), log=lambda _: None)
    assert runner.run(rows).count("ran") == 1
    first = load_result(catalog.run_dir("offline-clip8/ta"))["world"]
    assert first == world_build(catalog, runner.plan(rows)[0]) and len(first) == 12
    assert runner.run(rows).count("resumed") == 1 and len(calls) == 1

    (tmp_path / "worlds" / "clip" / "world.json").write_text('{"build": 2}')
    results, stale = collect(catalog, rows)
    assert results == {} and f"another build of the world (world.json sha1 {first}, now " in stale["offline-clip8/ta"]
    assert "another build" in markdown(build_table(catalog, "1", results, stale))
    assert runner.run(rows).count("ran") == 1 and len(calls) == 2
    assert load_result(catalog.run_dir("offline-clip8/ta"))["world"] != first
    assert set(collect(catalog, rows)[0]) == {"offline-clip8/ta"}


# -- the renderer --------------------------------------------------------------------------------------------------

def write_result(catalog, run, report, seconds=1.0):
    folder = catalog.run_dir(run.id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps({"id": run.id, "command": run.command, "report": report,
                                                    "stamp": "s", "depends_on": {}, "seconds": seconds,
                                                    "world": world_build(catalog, run)}))


def clip_report(values):
    report = {t: {"accuracy": v / 100, "loss": 1.0} for t, v in values.items()}
    report["average"] = {"accuracy": sum(values.values()) / len(values) / 100, "loss": 1.0}
    return report


def test_renderer_writes_paper_ours_and_diff(tmp_path):
    catalog = Catalog("hub", tmp_path)
    paper = PAPER["1"]["rows"]
    tasks = HUB_SETTINGS["b32-8"].tasks
    write_result(catalog, catalog.upstream_run("b32-8", "ta"), clip_report({t: paper["b32-8/ta"][t] + 0.3 for t in tasks}))
    featcal = {t: paper["b32-8/ta+featcal"][t] - 1.0 for t in tasks}
    # a report with sections (return_upstream) is read from the calibrator's own section
    write_result(catalog, catalog.calibrator_run("b32-8", "ta", "featcal"),
                 {"upstream": clip_report({t: 0.0 for t in tasks}), "featcal": clip_report(featcal)})
    for t in tasks:
        write_result(catalog, catalog.finetuned_run("b32-8", t), clip_report({t: paper["b32-8/finetuned"][t]}))
    stale = catalog.upstream_run("b32-8", "wudi")
    write_result(Catalog("hub", tmp_path, all_overrides=["seed=1"]),
                 Catalog("hub", tmp_path, all_overrides=["seed=1"]).upstream_run("b32-8", "wudi"), clip_report({"mnist": 1.0}))
    results, stale_results = collect(catalog, catalog.rows("1"))
    assert set(stale_results) == {stale.id}
    model = build_table(catalog, "1", results, stale_results)

    md = markdown(model)
    ta_avg = round(sum(paper["b32-8/ta"][t] + 0.3 for t in tasks) / 8, 1)
    assert f"| Task Arithmetic | 67.5 | {ta_avg:.1f} | {ta_avg - 67.5:+.1f} |" in md
    # the mean of its eight per-task runs (the paper's own eight cells average to 90.375; it prints 90.3)
    assert "| Fine-tuned (STL) | 90.3 | 90.4 | +0.1 |" in md
    assert "| Task Arithmetic | paper | 57.0 | 55.7 |" in md and "|  | diff | +0.3 | +0.3 |" in md
    assert "| WUDI-Merging (no result) | 84.5 |  |  |" in md and "another command line" in md
    assert "| Traditional MTL (not run) | 88.6 |  |  |" in md

    tex = latex(model)
    assert r"Task Arithmetic & paper & 57.0 & 55.7" in tex and r"& $\Delta$ & +0.3 & +0.3" in tex
    assert r"\begin{tabular}{ll" + "r" * 9 + "}" in tex

    rows = list(__import__("csv").DictReader(csv_text(model).splitlines()))
    cell = next(r for r in rows if r["row"] == "ta+featcal" and r["column"] == "svhn")
    assert (cell["paper"], float(cell["ours"]), float(cell["diff"])) == ("95.0", 94.0, -1.0)
    assert next(r for r in rows if r["row"] == "wudi" and r["column"] == "average")["status"] == "missing"
    written = write_tables([model], tmp_path / "tables")
    assert sorted(p.name for p in written) == ["table_1.csv", "table_1.md", "table_1.tex"]


def lm_eval_report(values):
    """What LMEvalTaskPool returns: each task's metrics with the chosen one as ``score`` (a fraction)."""
    report = {t: {"score": v / 100, "acc,none": v / 100} for t, v in values.items()}
    report["average"] = {"score": sum(values.values()) / len(values) / 100}
    return report


def test_table_4s_fine_tuned_row_takes_each_column_from_its_domains_expert_and_arc_c_from_the_base(tmp_path):
    catalog = Catalog("hub", tmp_path)
    paper = PAPER["4"]["rows"]["llama3.2-3b/finetuned"]
    (row,) = catalog.select(["4"], ["llama3.2-3b/finetuned"])
    assert {r.id: r.provides for r in row.runs} == {
        "llama3.2-3b/finetuned/math": ("math500_boxed", "gsm8k_cot"),
        "llama3.2-3b/finetuned/coding": ("evalplus_humaneval_chat", "evalplus_mbpp_chat"),
        "llama3.2-3b/finetuned/instruction": ("ifeval",),
        "llama3.2-3b/pretrained": ("arc_challenge_chat_lines",),
    }
    for run in row.runs:
        write_result(catalog, run, lm_eval_report({c: paper[c] for c in run.provides}))
    results, _ = collect(catalog, [row])
    md = markdown(build_table(catalog, "4", results, {}))
    # the paper prints 64.1; its six cells average 64.07
    assert "| Fine-tuned (STL) | 64.1 | 64.1 | +0.0 |" in md and "| Fine-tuned (STL) | paper | 49.0 | 80.6 |" in md


def test_renderer_offline_has_an_empty_paper_column_and_table_2_pivots_settings(tmp_path):
    catalog = Catalog("offline", tmp_path)
    tasks, _ = catalog.tasks("offline-clip8")
    write_result(catalog, catalog.upstream_run("offline-clip8", "ta"), clip_report({t: 30.0 for t in tasks}))
    results, _ = collect(catalog, catalog.rows("1"))
    model = build_table(catalog, "1", results)
    rows = list(__import__("csv").DictReader(csv_text(model).splitlines()))
    assert rows and all(r["paper"] == "" and r["diff"] == "" for r in rows)
    assert [r["column"] for r in rows if r["row"] == "ta"] == [*tasks, "average"]
    md = markdown(model)
    assert "| Task Arithmetic |  | 30.0 |  |" in md  # the averages: paper and diff empty
    grid = [[c.strip() for c in line.split("|")] for line in md.splitlines() if line.startswith("| ")]
    assert not any(cells[2] in ("paper", "diff") and cells[1] != "Method" for cells in grid)
    assert "| Task Arithmetic | ours | 30.0 |" in md

    hub = Catalog("hub", tmp_path / "hub")
    write_result(hub, hub.calibrator_run("b32-20", "ta", "featcal"), clip_report({"mnist": 80.0}))
    table2 = build_table(hub, "2", collect(hub, hub.rows("2"))[0])
    assert [c for c, _ in table2.blocks[0].columns] == ["l14-8", "b32-14", "l14-14", "b32-20", "l14-20"]
    row = next(r for r in table2.blocks[0].rows if r.method == "ta+featcal")
    assert (row.cells["b32-20"].paper, row.cells["b32-20"].ours, row.cells["b32-20"].shown_diff) == (79.4, 80.0, 0.6)
    assert "8-Task L/14" in markdown(table2)
    table3 = latex(build_table(hub, "3", {}))
    assert r"Spearman’s $\rho$" in table3 and "& STS-B & Avg." in table3 and "& ours & -- &" in table3


def test_renderer_lists_each_rows_wall_time_and_the_calibrators_own_time(tmp_path):
    catalog = Catalog("offline", tmp_path)
    tasks, _ = catalog.tasks("offline-clip8")
    write_result(catalog, catalog.upstream_run("offline-clip8", "ta"), clip_report({t: 30.0 for t in tasks}), 28.0)
    featcal = catalog.calibrator_run("offline-clip8", "ta", "featcal")
    write_result(catalog, featcal, clip_report({t: 35.0 for t in tasks}), 46.0)
    (catalog.run_dir(featcal.id) / "featcal_report.json").write_text(json.dumps({"seconds": 18.04}))
    # a calibrator run whose own report is missing still shows its wall time, with the calibration cell empty
    write_result(catalog, catalog.calibrator_run("offline-clip8", "ta", "surgery"), clip_report({t: 50.0 for t in tasks}),
                 474.0)
    for i, t in enumerate(tasks):
        write_result(catalog, catalog.finetuned_run("offline-clip8", t), clip_report({t: 60.0}), 10.0 + i)
    md = markdown(build_table(catalog, "1", collect(catalog, catalog.rows("1"))[0]))
    times = md[md.index("| Method | run (s) | calibration (s) |"):]
    assert "| ta | 28 |  |" in times and "| ta+featcal | 46 | 18.0 |" in times and "| ta+surgery | 474 |  |" in times
    assert f"| finetuned | {sum(10 + i for i in range(len(tasks)))} |  |" in times  # the per-task runs, summed
    assert "| wudi |" not in times  # no result, no time


def test_table_12_renders_mean_and_std_over_seeds_beside_the_papers_and_draws_it(tmp_path):
    catalog = Catalog("hub", tmp_path)
    tasks = HUB_SETTINGS["b32-8"].tasks
    row = next(r for r in catalog.rows("12") if r.method == "ta+featcal")
    for run, accuracy in zip(row.runs[:3], (80.0, 82.0, 84.0)):  # n = 8, three seeds
        write_result(catalog, run, clip_report({t: accuracy for t in tasks}))
        (catalog.run_dir(run.id) / "featcal_report.json").write_text(json.dumps({"seconds": accuracy / 10}))
    write_result(catalog, row.runs[3], {"featcal": clip_report({t: 90.0 for t in tasks})})  # n = 16, one seed
    model = build_table(catalog, "12", collect(catalog, catalog.rows("12"))[0])
    cells = model.blocks[0].rows[2].cells
    assert (cells["n8"].ours, cells["n8"].ours_std, cells["n8"].seeds) == (pytest.approx(82.0), pytest.approx(2.0), 3)
    assert (cells["n8"].paper, cells["n8"].paper_std, cells["n8"].shown_diff) == (82.9, 0.3, -0.9)
    md = markdown(model)
    assert "| w/ FeatCal (partial) | paper | 82.9 ± 0.3 | 83.8 ± 0.2 |" in md
    assert "|  | ours | 82.0 ± 2.0 | 90.0 (1 seed) | – |" in md and "|  | diff | -0.9 | +6.2 |" in md
    assert "| w/ Surgery | 8.0 | 8.2 |" not in md and "| w/ FeatCal | 8.2 |  |" in md  # seconds: mean of the seeds
    assert r"82.0 $\pm$ 2.0" in latex(model)
    rows = list(__import__("csv").DictReader(csv_text(model).splitlines()))
    cell = next(r for r in rows if r["row"] == "ta+featcal" and r["column"] == "n8")
    assert (cell["paper_std"], float(cell["ours_std"]), cell["seeds"]) == ("0.3", 2.0, "3")
    written = write_tables([model], tmp_path / "tables")
    assert (tmp_path / "tables" / "table_12.png") in written and (tmp_path / "tables" / "table_12.png").stat().st_size


def test_the_llm_sample_budget_table_gives_each_tasks_mean_the_calibration_time_and_peak_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_WORLDS_DIR", str(tmp_path / "worlds"))
    catalog = Catalog("offline", tmp_path / "runs")
    row = next(r for r in catalog.rows("12-llm") if r.method == "ta+featcal")
    for run, (math, seconds, peak) in zip(row.runs[:2], ((60.0, 10.0, 2 * 2**30), (70.0, 12.0, 4 * 2**30))):
        assert run.budget[0] == 8
        write_result(catalog, run, lm_eval_report({"llm_math": math, "llm_code": 100.0, "llm_instruction": 80.0}))
        (catalog.run_dir(run.id) / "featcal_report.json").write_text(
            json.dumps({"seconds": seconds, "peak_rss_bytes": peak}))
    model = build_table(catalog, "12-llm", collect(catalog, catalog.rows("12-llm"))[0])
    assert not model.has_paper and [c for c, _ in model.blocks[0].columns] == ["n8", "n32", "n128"]
    md = markdown(model)
    assert "| w/ FeatCal (partial) | ours | 81.7 ± 2.4 (2 seeds) | – | – |" in md
    assert "| Method | n | seeds | llm_math | llm_code | llm_instruction | Avg. | calibration (s) | peak RSS (GiB) |" in md
    assert "| w/ FeatCal | 8 | 2 | 65.0 | 100.0 | 80.0 | 81.7 | 11.0 | 3.00 |" in md
    assert "| w/ Surgery |" not in md.split("Per task")[1]  # no result, no line
    hub = markdown(build_table(Catalog("hub", tmp_path / "hub"), "12-llm", {}))
    assert "not available: the paper's sample budget is CLIP-ViT-B/32's" in hub


def test_rendered_tables_name_the_runs_folder_without_the_machines_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = markdown(build_table(Catalog("offline", tmp_path / "outputs" / "runs"), "1", {}))
    assert "Runs: `outputs/runs`." in inside and str(tmp_path) not in inside
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert "Runs: `~/r`." in markdown(build_table(Catalog("offline", tmp_path / "home" / "r"), "1", {}))


def test_calibrators_save_their_reports_under_the_name_the_renderer_reads():
    from featcal_fusionbench.integration.algorithm import REPORT_NAME
    from featcal_fusionbench.baselines.algorithm import ProbSurgeryAlgorithm, SurgeryAlgorithm

    names = {"featcal": REPORT_NAME, "surgery": SurgeryAlgorithm.report_name,
             "probsurgery": ProbSurgeryAlgorithm.report_name}
    assert set(names) == set(CALIBRATORS)
    assert all(name == f"{calibrator}_report.json" for calibrator, name in names.items())


def test_scores_reads_text_reports_with_spearman_and_the_average():
    report = {"glue-cola": {"accuracy": 0.7}, "glue-stsb": {"spearman_rho": 0.8}, "average": {"score": 0.75}}
    assert scores(report) == pytest.approx({"glue-cola": 70.0, "glue-stsb": 80.0, "average": 75.0})
