"""The paper commands of the README and docs/paper_settings.md, as typed, against a hub of our own on 127.0.0.1
(tests/hubmirror).

CLIP TA8 (both pool names), Surgery and ProbSurgery after Task Arithmetic, FeatCal after WUDI, FLAN-T5-base GLUE,
OpenCLIP and Table 4's Llama-3.2-3B-Instruct (gated base) each run through the real ``fusion_bench`` CLI in a process
of its own, online: ``HF_ENDPOINT`` names the mirror, the offline flags are unset, and an empty ``HF_HOME`` (no stored
token, nothing downloaded) makes each run a first run. The runs against the module's mirror share one ``HF_HOME``,
emptied before each, so that they fork from one process that imported their modules with that environment
(``commands.serving``). Only tiny budgets are appended (calibration examples, steps, iterations, loader
workers, examples per task and generated tokens). Traffic stays on the loopback: proxies for any other address point
at a closed loopback port, and telemetry is off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

import commands
from hubmirror.server import HubMirror
from hubmirror.standins import GLUE, TA8, build
from shared_builds import built_once

pytestmark = pytest.mark.slow  # the mirror's stand-ins are built, and most tests start the fusion_bench CLI

TOKEN = "hf_mirror_test_token"
TINY = ["method.num_calibration_examples=4"]
TINY_TA8 = [*TINY, "taskpool.dataloader_kwargs.num_workers=0"]  # FusionBench's template starts 8 per test set
TA8_POOLS = ["modelpool=CLIPVisionModelPool/clip-vit-base-patch32_TA8",
             "taskpool=CLIPVisionModelTaskPool/clip-vit-classification_TA8"]
# weight files of the base repositories that a torch run does not load
UNLOADED = ("tf_model.h5", "flax_model.msgpack")


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory, worker_id):
    return built_once(tmp_path_factory, worker_id, "hub_mirror", build)  # each worker serves it, none writes to it


#: mirror endpoint -> the HF_HOME folder its runs share (a forking server was started with it)
_SHARED_HOMES: Dict[str, Path] = {}


@pytest.fixture(scope="module")
def hub(hub_folder, tmp_path_factory):
    home = tmp_path_factory.mktemp("hub_client")
    with HubMirror(hub_folder, token=TOKEN) as mirror, commands.serving(hub_env(mirror, home)):
        _SHARED_HOMES[mirror.endpoint] = home
        yield mirror
        del _SHARED_HOMES[mirror.endpoint]


def client_home(hub: HubMirror, tmp_path: Path) -> Path:
    """The folder whose ``hf`` is the ``HF_HOME`` of a run against ``hub`` in ``tmp_path``."""
    return _SHARED_HOMES.get(hub.endpoint, tmp_path)


def hub_env(hub: HubMirror, home: Path, token: str = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, so a request for any other host fails at once
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(home / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               HTTP_PROXY=dead, HTTPS_PROXY=dead, http_proxy=dead,
               https_proxy=dead, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def fusion_bench(hub: HubMirror, tmp_path: Path, command: str, *appended: str, ok: bool = True, token=None) -> dict:
    """Run ``command`` (as the README writes it, ``fusion_bench`` first) with ``appended`` arguments in ``tmp_path``;
    return its program report, or the process when ``ok`` is False."""
    args = command.split()
    assert args[0] == "fusion_bench"
    home = client_home(hub, tmp_path)
    shutil.rmtree(home / "hf", ignore_errors=True)  # a first run: no token stored, nothing downloaded
    run = commands.run("fusion_bench", *args[1:], *appended, cwd=tmp_path, env=hub_env(hub, home, token),
                       timeout=900, offline=False)
    if not ok:
        return run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    reports = list(tmp_path.glob("outputs/**/program_report.json"))
    assert len(reports) == 1, reports
    return json.loads(reports[0].read_text())


def served(hub: HubMirror, since: int) -> set:
    """Repository paths (``datasets/ylecun/mnist``, ``openai/clip-vit-base-patch32``) of files fetched after ``since``."""
    names = set()
    for request in hub.log[since:]:
        if request.method == "GET" and request.status == 200 and "/resolve/" in request.path:
            names.add(request.path.split("/resolve/")[0].lstrip("/"))
    return names


def assert_ta8_report(section: dict) -> None:
    assert set(TA8) <= set(section), sorted(section)
    for task in TA8 + ["average"]:
        assert 0.0 <= section[task]["accuracy"] <= 1.0


def test_the_bare_ids_fusionbench_names_are_not_found_on_the_mirror(hub, tmp_path, monkeypatch):
    """As on the hub today: what makes FusionBench 0.2.33's own configs fail (docs/compatibility.md)."""
    script = ("import datasets, sys\n"
              "for args in (['mnist'], ['svhn', 'cropped_digits'], ['glue', 'cola']):\n"
              "    try:\n        datasets.load_dataset(*args, split='train')\n    except Exception as e:\n"
              "        print(type(e).__name__)\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=hub_env(hub, tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["DatasetNotFoundError"] * 3, run.stderr[-3000:]


def test_clip_ta8_readme_command(hub, tmp_path):
    since = len(hub.log)
    report = fusion_bench(hub, tmp_path, "fusion_bench method=featcal " + " ".join(TA8_POOLS), *TINY_TA8)
    assert_ta8_report(report)
    fetched = served(hub, since)
    assert {"datasets/ylecun/mnist", "datasets/ufldl-stanford/svhn", "openai/clip-vit-base-patch32"} <= fetched
    svhn = [p for p in hub.fetched("/datasets/ufldl-stanford/svhn/") if p.endswith(".parquet")]
    assert svhn and not [p for p in svhn if "/extra-" in p], svhn  # only the splits the pool reads
    assert {f"tanganke/clip-vit-base-patch32_{t}" for t in TA8} <= fetched
    # FusionBench's CLIP pool would snapshot the base repository whole, weights for TensorFlow and Flax included;
    # only what transformers loads is fetched (hub_access.fetch_only_loaded_files)
    base = hub.fetched("/openai/clip-vit-base-patch32/resolve/")
    assert any(path.endswith("pytorch_model.bin") for path in base), sorted(base)
    assert not any(path.endswith(UNLOADED) for path in base), sorted(base)


def test_clip_ta8_short_pool_name_with_upstream_evaluated(hub, tmp_path):
    report = fusion_bench(hub, tmp_path, "fusion_bench method=featcal/clip_ta method.return_upstream=true "
                          "modelpool=clip-vit-base-patch32_TA8 taskpool=CLIPVisionModelTaskPool/clip-vit-classification_TA8",
                          *TINY_TA8)
    assert_ta8_report(report["upstream"])
    assert_ta8_report(report["featcal"])


@pytest.mark.parametrize("method", ["surgery/clip_ta", "probsurgery/clip_ta"])
def test_surgery_and_probsurgery_after_task_arithmetic(hub, tmp_path, method):
    report = fusion_bench(hub, tmp_path, f"fusion_bench method={method} " + " ".join(TA8_POOLS),
                          *TINY_TA8, "method.max_steps=2", "method.batch_size=4")
    assert_ta8_report(report)


def test_featcal_after_wudi(hub, tmp_path):
    report = fusion_bench(hub, tmp_path, "fusion_bench method=featcal/clip_wudi " + " ".join(TA8_POOLS),
                          *TINY_TA8, "method.upstream.iter_num=2")
    assert_ta8_report(report)


def test_flan_t5_glue_readme_command(hub, tmp_path):
    since = len(hub.log)
    report = fusion_bench(hub, tmp_path, "fusion_bench method=featcal/flan_t5_ta method.return_upstream=true "
                          "modelpool=Seq2SeqLMPool/flan-t5-base_glue taskpool=flan-t5_glue_text_generation_average",
                          *TINY)
    assert "datasets/nyu-mll/glue" in served(hub, since)
    base = hub.fetched("/google/flan-t5-base/resolve/")  # from_pretrained: safetensors only, no other format
    assert any(p.endswith("model.safetensors") for p in base), sorted(base)
    assert not any(p.endswith(("pytorch_model.bin",) + UNLOADED) for p in base), sorted(base)
    for model in ("upstream", "featcal"):
        section = report[model]
        assert {f"glue-{t}" for t in GLUE} <= set(section)
        average = section["average"]
        if average["score"] is None:  # STS-B's rho on constant outputs: said, not averaged as NaN
            assert "glue-stsb" in average["note"] and 0.0 <= average["score_of_defined"] <= 1.0
        else:
            assert 0.0 <= average["score"] <= 1.0 or average["score"] < 0  # a rho may be negative


def test_openclip_readme_command(hub, tmp_path):
    """The task-vector checkpoints are local files (FusionBench's config: ./.cache/task_vectors_checkpoints); the
    datasets come from the hub. Full ViT-B/32 shapes, random weights; two distinct checkpoints (base, one expert
    linked under every task's name) keep the disk to 0.7 GB. The last block's modules alone are calibrated (the
    budget here: at full width, the solves of all twelve took most of a minute; the OpenCLIP world's tests calibrate
    every block); every block still runs forward for every task."""
    write_task_vector_checkpoints(tmp_path / ".cache" / "task_vectors_checkpoints" / "ViT-B-32")
    report = fusion_bench(hub, tmp_path, "fusion_bench method=featcal/openclip_ta "
                          "modelpool=OpenCLIPVisionModelPool/ViT-B-32_TA8_quickgelu "
                          "taskpool=OpenCLIPVisionModelTaskPool/ViT-B-32_TA8_active_task",
                          "method.num_calibration_examples=2", "taskpool.dataloader_kwargs.num_workers=0",
                          "method.module_regex=resblocks.11.")
    assert_ta8_report(report)
    [featcal_report] = tmp_path.glob("outputs/**/featcal_report.json")
    blocks = json.loads(featcal_report.read_text())["blocks"]
    assert len(blocks) == 12 and [b["block"] for b in blocks if b["modules"]] == [11], blocks


# FusionBench's OpenCLIPVisionModelPool/ViT-B-32_TA8.yaml: task -> checkpoint folder and head name
_TASK_VECTOR_NAMES = {"sun397": "SUN397", "stanford-cars": "Cars", "resisc45": "RESISC45", "eurosat": "EuroSAT",
                      "svhn": "SVHN", "gtsrb": "GTSRB", "mnist": "MNIST", "dtd": "DTD"}


def write_task_vector_checkpoints(folder: Path) -> None:
    import torch
    from fusion_bench.models.open_clip import ClassificationHead
    from fusion_bench.tasks.clip_classification import get_classnames_and_templates

    from featcal_fusionbench.integration.openclip_pools import CheckpointImageEncoder

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    base = CheckpointImageEncoder("ViT-B-32")
    torch.save(base, folder / "zeroshot.pt")
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))
    torch.save(base, folder / "expert.pt")
    for task, name in _TASK_VECTOR_NAMES.items():
        (folder / name).mkdir()
        os.link(folder / "expert.pt", folder / name / "finetuned.pt")
        classes = len(get_classnames_and_templates(task)[0])
        head = ClassificationHead(normalize=True, weights=torch.randn(classes, 512))
        torch.save(head, folder / f"head_{name}.pt")


def test_a_gated_repository_says_how_to_log_in_before_any_download(hub, tmp_path):
    # the module's mirror, gated for this run (the mirror reads its gated set at each request): the run is forked
    # from the process that imported its modules with that mirror's environment
    since, base = len(hub.log), "models/openai/clip-vit-base-patch32"
    hub.gated.add(base)
    try:
        run = fusion_bench(hub, tmp_path, "fusion_bench method=featcal " + " ".join(TA8_POOLS), *TINY, ok=False)
    finally:
        hub.gated.discard(base)
    assert run.returncode != 0
    message = " ".join(run.stderr.split())  # the CLI's error panel wraps lines
    assert "modelpool.models._pretrained_: 'openai/clip-vit-base-patch32' is a gated model" in message, message[-3000:]
    assert "huggingface-cli login" in message and "HF_TOKEN" in message
    assert served(hub, since) == set()  # failed before any file was downloaded


def test_the_check_passes_a_gated_repository_with_its_token(hub_folder, monkeypatch):
    from huggingface_hub import constants

    from featcal_fusionbench.integration.hub_access import check_hub_access

    with HubMirror(hub_folder, token=TOKEN, gated={"models/openai/clip-vit-base-patch32"}) as gated:
        monkeypatch.setattr(constants, "ENDPOINT", gated.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        check_hub_access([("modelpool.models._pretrained_", "openai/clip-vit-base-patch32", "model")])
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        with pytest.raises(PermissionError, match="gated model"):
            check_hub_access([("modelpool.models._pretrained_", "openai/clip-vit-base-patch32", "model")])


def test_a_merged_model_path_that_is_no_path_nor_hub_id_fails_at_once(hub, tmp_path):
    run = fusion_bench(hub, tmp_path, "fusion_bench method=featcal method.merged_model_path=/nonexistent/merged "
                       + " ".join(TA8_POOLS), ok=False)
    assert ("method.merged_model_path='/nonexistent/merged': no such file or folder, and not a hub id"
            in " ".join(run.stderr.split()))
    assert not list(client_home(hub, tmp_path).glob("hf/hub/models--*"))  # nothing was downloaded


def test_a_well_formed_id_that_does_not_exist_says_so_before_any_download(hub, tmp_path):
    since = len(hub.log)
    run = fusion_bench(hub, tmp_path, "fusion_bench method=featcal method.merged_model_path=someone/no-such-merge "
                       + " ".join(TA8_POOLS), ok=False)
    assert ("method.merged_model_path: 'someone/no-such-merge' is neither a local path nor a model on the Hugging "
            "Face hub") in " ".join(run.stderr.split()), run.stderr[-3000:]
    assert not [r for r in hub.log[since:] if r.method == "GET" and "/resolve/" in r.path]


TABLE4 = ("fusion_bench method=featcal/mergebench_llama3.2_3b_ta method.return_upstream=true "
          "modelpool=CausalLMPool/mergebench_table4/Llama-3.2-3B-Instruct taskpool=LMEvalHarnessTaskPool/mergebench_table4")
TABLE4_TASKS = ["math500_boxed", "gsm8k_cot", "evalplus_humaneval_chat", "evalplus_mbpp_chat", "ifeval",
                "arc_challenge_chat_lines"]
TINY_LLM = ["method.num_calibration_examples=2", "taskpool.limit=2", "+taskpool.gen_kwargs={max_gen_toks:16}"]


def test_table4_readme_command_with_a_token(hub, tmp_path):
    """The gated base with an accepted token, MergeBench's experts and calibration sets, and the six columns scored
    by their protocols (our task files and lm-eval's), generated code run in the sandbox."""
    since = len(hub.log)
    report = fusion_bench(hub, tmp_path, TABLE4, *TINY_LLM, token=TOKEN)
    for model in ("upstream", "featcal"):
        assert list(report[model])[:6] == TABLE4_TASKS
        for task in TABLE4_TASKS:
            assert 0.0 <= report[model][task]["score"] <= 1.0 and report[model][task]["sample_len"] == 2.0
        assert 0.0 <= report[model]["average"]["score"] <= 1.0
    fetched = served(hub, since)
    datasets = {"HuggingFaceH4/MATH-500", "openai/gsm8k", "evalplus/humanevalplus", "evalplus/mbppplus",
                "google/IFEval", "allenai/ai2_arc", "MergeBench/instruction_val", "MergeBench/math_val",
                "MergeBench/coding_val"}
    assert {f"datasets/{d}" for d in datasets} <= fetched, sorted(fetched)
    assert {"meta-llama/Llama-3.2-3B-Instruct"} | {f"MergeBench/Llama-3.2-3B-Instruct_{d}"
                                                   for d in ("instruction", "math", "coding")} <= fetched


def test_table4_without_a_token_names_the_gated_base_before_any_download(hub, tmp_path):
    """As on the hub, the gated base's info is public (the mirror answers it with "gated": "manual"); its files and
    /auth-check are refused, and the run stops there, before it fetches anything, with our message."""
    since = len(hub.log)
    run = fusion_bench(hub, tmp_path, TABLE4, *TINY_LLM, ok=False)
    message = " ".join(run.stderr.split())
    assert ("modelpool.models._pretrained_: 'meta-llama/Llama-3.2-3B-Instruct' is a gated model on the Hugging Face "
            "hub") in message, run.stderr[-3000:]
    assert "huggingface-cli login" in message
    asked = hub.log[since:]
    assert any(r.path == "/api/models/meta-llama/Llama-3.2-3B-Instruct" and r.status == 200 for r in asked)
    assert any(r.path.endswith("/auth-check") and r.status == 401 for r in asked)
    assert not [r for r in asked if r.method == "GET" and "/resolve/" in r.path]


def test_table4_with_mergebench_code_protocol(hub, tmp_path):
    """HumanEval+ and MBPP+ as MergeBench's bigcode runs score them: 10 sampled completions of the bare prompt."""
    command = TABLE4.replace(" method.return_upstream=true", "").replace(
        "LMEvalHarnessTaskPool/mergebench_table4", "LMEvalHarnessTaskPool/mergebench_table4_bigcode")
    report = fusion_bench(hub, tmp_path, command, "method.num_calibration_examples=2", "taskpool.limit=1",
                          "+taskpool.gen_kwargs={max_gen_toks:16}", token=TOKEN)
    assert list(report)[:6] == ["math500_boxed", "gsm8k_cot", "ifeval", "arc_challenge_chat_lines",
                                "humanevalplus_bigcode", "mbppplus_bigcode"]
    for task in ("humanevalplus_bigcode", "mbppplus_bigcode"):
        assert 0.0 <= report[task]["score"] <= report[task]["pass@10,all_samples"] <= 1.0 and report[task]["sample_len"] == 1.0
    results = json.loads(next(tmp_path.glob("outputs/**/lm_eval_results/humanevalplus_bigcode.json")).read_text())
    assert results["configs"]["humanevalplus_bigcode"]["repeats"] == 10
    assert results["configs"]["humanevalplus_bigcode"]["generation_kwargs"]["temperature"] == 0.2


def test_the_sources_checked_are_every_hub_id_a_run_names():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from featcal_fusionbench.integration.hub_access import pool_sources

    config = Path(__file__).resolve().parents[1] / "config"
    calibration = OmegaConf.load(config / "calibration_datasets" / "mergebench.yaml")
    pool = OmegaConf.load(config / "modelpool" / "CausalLMPool" / "mergebench_table4" / "Llama-3.2-3B-Instruct.yaml")
    modelpool = SimpleNamespace(_models=pool.models, _tokenizer=pool.tokenizer, _train_datasets=OmegaConf.create({
        "local": {"_target_": "datasets.load_from_disk", "dataset_path": "/somewhere"},
        "svhn": {"_target_": "datasets.load_dataset", "_args_": ["ufldl-stanford/svhn", "cropped_digits"]},
        "relative": {"_target_": "datasets.load_dataset", "path": "${...nowhere}"}}))  # left to the loader
    sources = list(pool_sources(modelpool, calibration, tasks=["instruction", "math", "coding"]))
    assert ("modelpool.models._pretrained_", "meta-llama/Llama-3.2-3B-Instruct", "model") in sources
    assert ("modelpool.tokenizer", "meta-llama/Llama-3.2-3B-Instruct", "model") in sources
    assert ("modelpool.train_datasets.svhn", "ufldl-stanford/svhn", "dataset") in sources
    assert ("method.calibration_datasets.math", "MergeBench/math_val", "dataset") in sources
    assert not [s for s in sources if s[0].endswith((".local", ".relative"))]
    # the config also lists multilingual and safety, experts this pool does not hold: not asked for
    assert not [s for s in sources if s[0].endswith((".multilingual", ".safety"))]
    assert ("method.calibration_datasets.safety", "MergeBench/safety_val", "dataset") in pool_sources(
        modelpool, calibration)


OUT_OF_CORE = ("fusion_bench method=featcal/mergebench_llama3.2_3b_ta method.out_of_core=true "
               "modelpool=CausalLMPool/mergebench_table4/Llama-3.2-3B-Instruct "
               "taskpool=LMEvalHarnessTaskPool/mergebench_table4 merged_model_save_path=outputs/llama3.2-3b-ta-featcal")


def test_table4_out_of_core_command_reads_hub_ids_block_by_block_as_whole_models_calibrate(hub, tmp_path):
    """docs/featcal.md's out-of-core command as typed: the gated base and MergeBench's experts read from their hub
    snapshots a block at a time, their Task Arithmetic computed tensor by tensor, the calibrated model written as it
    goes and scored by Table 4's six protocols. The same configuration with whole models saves the same tensors."""
    import torch

    from featcal_fusionbench.models.lazy import CheckpointTensors

    since = len(hub.log)
    (tmp_path / "ooc").mkdir()
    report = fusion_bench(hub, tmp_path / "ooc", OUT_OF_CORE, *TINY_LLM, token=TOKEN)
    assert list(report)[:6] == TABLE4_TASKS, sorted(report)
    assert all(report[task]["sample_len"] == 2.0 for task in TABLE4_TASKS)
    assert {"meta-llama/Llama-3.2-3B-Instruct"} | {f"MergeBench/Llama-3.2-3B-Instruct_{d}"
                                                   for d in ("instruction", "math", "coding")} <= served(hub, since)
    out_of_core = tmp_path / "ooc" / "outputs" / "llama3.2-3b-ta-featcal"
    assert (out_of_core / "model.safetensors.index.json").is_file()
    assert not [p.name for p in out_of_core.parent.iterdir() if ".partial" in p.name]
    [featcal_report] = (tmp_path / "ooc").glob("outputs/**/featcal_report.json")
    featcal_report = json.loads(featcal_report.read_text())
    assert featcal_report["models_in_memory"] == "none" and featcal_report["upstream"].endswith("(out of core)"), featcal_report

    whole = OUT_OF_CORE.replace(" method.out_of_core=true", " method.models_in_memory=all").replace(
        "taskpool=LMEvalHarnessTaskPool/mergebench_table4", "taskpool=dummy")
    (tmp_path / "whole").mkdir()
    fusion_bench(hub, tmp_path / "whole", whole, *TINY_LLM[:1], token=TOKEN)
    saved = []
    for folder in (out_of_core, tmp_path / "whole" / "outputs" / "llama3.2-3b-ta-featcal"):
        tensors = CheckpointTensors(folder)
        saved.append(tensors.read(tensors.files))
    assert saved[0] and saved[0].keys() == saved[1].keys()
    assert [k for k in saved[0] if not torch.equal(saved[0][k], saved[1][k])] == []


OUT_OF_CORE_AUTO = ("fusion_bench method=featcal/mergebench_llama3.2_3b_ta method.models_in_memory=none "
                    "method.auto_select=true method.return_upstream=true "
                    "modelpool=CausalLMPool/mergebench_table4/Llama-3.2-3B-Instruct "
                    "taskpool=LMEvalHarnessTaskPool/mergebench_table4 "
                    "merged_model_save_path=outputs/llama3.2-3b-ta-featcal-auto")


def test_table4_out_of_core_auto_select_command_scores_the_upstream_and_featcal(hub, tmp_path):
    """docs/featcal.md's second out-of-core command as typed: lambda and rho chosen per block on held-out moments in
    the one pass, the upstream written beside the calibrated model, both scored by Table 4's protocols in turn."""
    report = fusion_bench(hub, tmp_path, OUT_OF_CORE_AUTO, *TINY_LLM, "method.num_calibration_examples=4",
                          token=TOKEN)
    for model in ("upstream", "featcal"):
        assert list(report[model])[:6] == TABLE4_TASKS, sorted(report[model])
    out = tmp_path / "outputs" / "llama3.2-3b-ta-featcal-auto"
    for folder in (out, out.with_name(out.name + "_upstream")):
        assert (folder / "model.safetensors.index.json").is_file(), folder
    [featcal_report] = tmp_path.glob("outputs/**/featcal_report.json")
    featcal_report = json.loads(featcal_report.read_text())
    auto = featcal_report["auto_select"]
    assert auto["criterion"] == "objective" and auto["calibrations"] == 1
    assert len(auto["choice"]["per_block"]) == featcal_report["num_blocks"]
    assert featcal_report["output"]["upstream_path"].endswith("llama3.2-3b-ta-featcal-auto_upstream")
