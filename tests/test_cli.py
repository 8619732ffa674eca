"""The `fusion_bench` CLI with this plugin installed, offline, on the toy world."""

import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import commands

REPO = Path(__file__).resolve().parents[1]
METHOD_CONFIGS = sorted(
    str(p.relative_to(REPO / "config" / "method").with_suffix("")) for p in (REPO / "config" / "method").rglob("*.yaml")
)


def fusion_bench(*args, cwd, check=True):
    result = commands.run("fusion_bench", *args, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"fusion_bench {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def toy_args(toy_world, *extra):
    """The method's options first and the world's arguments after them, as users type them (`fusion_bench
    method=featcal $(featcal-world args toy)`); the world adds its config folder as `featcal-world args` does."""
    return [
        *extra,
        f"hydra.searchpath=[file://{toy_world['config_dir']}]",
        "modelpool=CLIPVisionModelPool/toy",
        "taskpool=CLIPVisionModelTaskPool/toy",
        "method.num_calibration_examples=16",
    ]


@pytest.fixture
def fusion_bench_config_dir():
    import fusion_bench_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        yield
    GlobalHydra.instance().clear()


POOLS = {
    "clip": ["modelpool=CLIPVisionModelPool/clip-vit-base-patch32_TA8", "taskpool=CLIPVisionModelTaskPool/clip-vit-classification_TA8"],
    "flan_t5": ["modelpool=Seq2SeqLMPool/flan-t5-base_glue", "taskpool=flan-t5_glue_text_generation_average"],
    "flan_t5_large": ["modelpool=Seq2SeqLMPool/flan-t5-large_glue_lora16", "taskpool=flan-t5_glue_text_generation_average"],
}
GLUE_TASKS = [f"glue-{t}" for t in ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")]
POOLS["mergebench_llama3.2_3b"] = ["modelpool=CausalLMPool/mergebench_table4/Llama-3.2-3B-Instruct", "taskpool=dummy"]
POOLS["mergebench_llama3.1_8b"] = ["modelpool=CausalLMPool/mergebench_table4/Llama-3.1-8B-Instruct", "taskpool=dummy"]
POOLS["causal_lm"] = POOLS["mergebench_llama3.2_3b"]
TABLE4_TASKS = ["coding", "instruction", "math"]


def family(name):
    setting = name.split("/")[-1].removeprefix("auto_")  # a label-free config starts from its setting's values
    for prefix in ("flan_t5_large", "flan_t5", "mergebench_llama3.2_3b", "mergebench_llama3.1_8b", "causal_lm"):
        if setting.startswith(prefix):
            return prefix
    return "clip"


def compose_method(name):
    cfg = compose("fabric_model_fusion", overrides=[f"method={name}", *POOLS[family(name)]])
    if family(name).startswith("flan_t5"):  # the pools name their experts as the calibration datasets do
        assert sorted(cfg.modelpool.models) == ["_pretrained_", *GLUE_TASKS]
        assert sorted(cfg.method.calibration_datasets) == GLUE_TASKS
        assert sorted(cfg.taskpool.test_datasets) == GLUE_TASKS
    if family(name).startswith("mergebench"):  # Table 4's three experts, each with its calibration dataset
        assert sorted(cfg.modelpool.models) == ["_pretrained_", *TABLE4_TASKS]
        assert set(TABLE4_TASKS) <= set(cfg.method.calibration_datasets)
    method = OmegaConf.to_container(cfg.method, resolve=True)
    assert method["upstream"]["_target_"].startswith("fusion_bench.method.")
    assert method["num_calibration_examples"] == 256
    import featcal_fusionbench

    target = method.pop("_target_")
    assert target.startswith("featcal_fusionbench.")
    getattr(featcal_fusionbench, target.split(".")[-1])(**method)  # every entry is a constructor argument
    return target, method


def test_there_are_featcal_surgery_and_probsurgery_configs_for_every_upstream():
    for method in ("featcal", "surgery", "probsurgery"):
        for upstream in ("clip_ta", "clip_simple_average", "clip_adamerging", "clip_wudi", "flan_t5_ta"):
            assert f"{method}/{upstream}" in METHOD_CONFIGS
    assert "featcal/flan_t5_large_ta" in METHOD_CONFIGS


@pytest.mark.parametrize("name", [n for n in METHOD_CONFIGS if n.startswith("featcal")])
def test_every_featcal_config_composes_with_the_paper_settings(fusion_bench_config_dir, name):
    target, method = compose_method(name)
    assert target == "featcal_fusionbench.FeatCalAlgorithm"
    paper = {"lambda_": 0.05, "rho": 2.0, "alpha": 0.3, "family_options": {}}  # last-block patch weight 1.0
    demo = {"lambda_": 0.05, "rho": 2.2, "alpha": 0.25, "family_options": {"last_block_patch_token_weight": 0.01}}
    flan_t5 = {"lambda_": 1e-5, "rho": 2.0, "alpha": 0.6, "calibrate_bias": True, "calibrate_layernorm": False,
               "family_options": {}}
    llm = {"rho": 0.5, "alpha": 0.15, "family_options": {}}  # Sec. 5.1; lambda per model
    expected = (demo if name.endswith("_demo") else paper if family(name) == "clip"
                else {**llm, "lambda_": 3.0} if family(name) == "mergebench_llama3.1_8b"
                else {**llm, "lambda_": 1e-5} if family(name) in ("mergebench_llama3.2_3b", "causal_lm") else flan_t5)
    assert {k: method[k] for k in expected} == expected


@pytest.mark.parametrize("name", [n for n in METHOD_CONFIGS if n.split("/")[0] in ("surgery", "probsurgery")])
def test_every_baseline_config_composes_with_the_paper_defaults(fusion_bench_config_dir, name):
    target, method = compose_method(name)
    assert target.endswith("ProbSurgeryAlgorithm" if name.startswith("prob") else ".SurgeryAlgorithm")
    assert (method["max_steps"], method["batch_size"], method["lr"]) == (1000, 16, 1e-3)
    assert method["calibration_split"] == "train" and method["eval_iterations"] is None
    if name.startswith("prob"):
        assert (method["hidden_dim"], method["kl_weight"]) == (128, 1e-4)
    else:
        assert method["rank"] == 16


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_probsurgery_runs_through_the_cli_and_is_evaluated_by_the_surgery_hook(toy_world, tmp_path):
    fusion_bench(
        *toy_args(toy_world, "method=probsurgery/clip_ta", "method.max_steps=2", "method.return_upstream=true",
                  f"path.log_dir={tmp_path}"),
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "program_report.json").read_text())
    assert set(report) >= {"upstream", "probsurgery", "probsurgery_calibration"}
    assert "average" in report["probsurgery"]
    assert report["probsurgery_calibration"]["features"] == "streamed"


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_method_resolves_from_the_repository_root_despite_its_config_folder():
    """The CLI makes ./config its primary config path here; the plugin must keep FusionBench's configs reachable."""
    result = fusion_bench("--cfg", "job", "method=featcal", "method.lambda_=0.01", cwd=REPO)
    cfg = OmegaConf.create(result.stdout)
    assert cfg.method._target_ == "featcal_fusionbench.FeatCalAlgorithm"
    assert cfg.method.lambda_ == 0.01
    assert cfg._target_ == "fusion_bench.programs.FabricModelFusionProgram"


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_end_to_end_offline_run_evaluates_and_saves_the_calibrated_model(toy_world, tmp_path):
    log_dir = tmp_path / "log"
    fusion_bench(
        *toy_args(toy_world, "method=featcal", f"path.log_dir={log_dir}", f"merged_model_save_path={tmp_path / 'saved'}"),
        cwd=tmp_path,
    )
    report = json.loads((log_dir / "program_report.json").read_text())
    assert set(report) >= {"toy_0", "toy_1", "average"}
    assert 0.0 <= report["average"]["accuracy"] <= 1.0
    calibration = json.loads((log_dir / "featcal_report.json").read_text())
    assert calibration["upstream"] == "method:fusion_bench.method.TaskArithmeticAlgorithm"
    assert len(calibration["blocks"]) == 2
    from transformers import CLIPVisionModel

    saved = CLIPVisionModel.from_pretrained(tmp_path / "saved")
    pretrained = CLIPVisionModel.from_pretrained(toy_world["root"] / "pretrained")
    assert saved.state_dict().keys() == pretrained.state_dict().keys()


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_two_value_multirun_reports_upstream_and_featcal_for_each_value_in_its_own_folder(toy_world, tmp_path):
    """FusionBench's log folder is time-named and a sweep's jobs share the time; each job's reports land in its own
    folder of the sweep all the same (config_fixes/path/default.yaml), FusionBench's default paths left as they are."""
    fusion_bench("-m", *toy_args(toy_world, "method=featcal", "method.return_upstream=true", "method.lambda_=0.01,0.5"),
                 cwd=tmp_path)
    sweeps = list((tmp_path / "outputs" / "multirun" / "fabric_model_fusion").iterdir())
    assert len(sweeps) == 1
    jobs = [sweeps[0] / str(i) for i in range(2)]
    reports = [json.loads((job / "program_report.json").read_text()) for job in jobs]
    for report in reports:
        assert set(report) >= {"upstream", "featcal", "featcal_calibration"}
        assert "average" in report["featcal"]
    lambdas = [json.loads((job / "featcal_report.json").read_text())["hparams"]["lambda_"] for job in jobs]
    assert lambdas == [0.01, 0.5]
    for job, value in zip(jobs, ("0.01", "0.5")):  # Hydra's own record of the job, in the same folder
        assert f"method.lambda_={value}" in yaml.safe_load((job / "overrides.yaml").read_text())
    assert not (tmp_path / "outputs" / "fabric_model_fusion").exists()  # no folder shared by the jobs
    # the upstream model is the same Task Arithmetic merge in both jobs
    assert reports[0]["upstream"]["average"] == reports[1]["upstream"]["average"]


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_a_baselines_multirun_writes_each_jobs_report_into_its_own_folder(toy_world, tmp_path):
    fusion_bench("-m", *toy_args(toy_world, "method=surgery/clip_ta", "method.max_steps=1,2"), cwd=tmp_path)
    (sweep,) = (tmp_path / "outputs" / "multirun" / "fabric_model_fusion").iterdir()
    reports = [json.loads((sweep / str(i) / "surgery_report.json").read_text()) for i in range(2)]
    assert [r["max_steps"] for r in reports] == [1, 2]
    assert all((sweep / str(i) / "program_report.json").is_file() for i in range(2))
    # the sweep report reads a baseline's runs alike: its swept value, its scores, its report's time
    from featcal_fusionbench.reports.sweep import Sweep

    table = Sweep(sweep)
    assert table.keys == ["method.max_steps"] and not table.failed
    assert sorted((r.value("method.max_steps"), r.seconds) for r in table.scored) == [
        (1, reports[0]["seconds"]), (2, reports[1]["seconds"])]
    average = table.figure().axes[0]  # one swept value: a line over it, the best marked
    assert (average.get_title(), average.get_xlabel()) == ("average", "method.max_steps")
    assert list(average.lines[0].get_xdata()) == [1, 2] and average.lines[1].get_label() == "best"


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_bad_input_on_the_command_line_fails_with_the_reason(toy_world, tmp_path):
    result = fusion_bench(*toy_args(toy_world, "method=featcal", "method.alpha=1.5"), cwd=tmp_path, check=False)
    assert result.returncode != 0
    assert "alpha must lie in [0, 1]" in result.stdout + result.stderr
