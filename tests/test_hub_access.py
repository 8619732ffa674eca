"""The access check asks the hub as the hub enforces access: a gated repository's info is public (huggingface_hub
issue #2457), so only ``/auth-check`` (or a file) says whether this machine's token may read it. Against the test
mirror (tests/hubmirror) holding one tiny gated repository; the README's commands on the full mirror are in
test_hub_mirror.py."""

import json

import pytest
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import GatedRepoError
from huggingface_hub.utils import get_session, hf_raise_for_status

from featcal_fusionbench.integration.hub_access import check_hub_access
from hubmirror.server import HubMirror

REPO, TOKEN = "meta-llama/Llama-3.2-3B-Instruct", "hf_granted"
SOURCE = [("modelpool.models._pretrained_", REPO, "model")]


@pytest.fixture
def gated_hub(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models" / REPO
    repo.mkdir(parents=True)
    (repo / "README.md").write_text("---\nlicense: llama3.2\n---\n")
    (repo / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hub" / "gated.json").write_text(json.dumps([f"models/{REPO}"]))
    with HubMirror(tmp_path / "hub", token=TOKEN) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


def test_the_mirror_serves_a_gated_repositorys_info_and_card_to_anyone_and_refuses_its_files(gated_hub):
    api = HfApi(endpoint=gated_hub.endpoint, token=False)
    assert api.model_info(REPO).gated == "manual"
    assert "config.json" in {s.rfilename for s in api.model_info(REPO).siblings}
    url = f"{gated_hub.endpoint}/{REPO}/resolve/main/"
    hf_raise_for_status(get_session().head(url + "README.md"))
    with pytest.raises(GatedRepoError) as refused:
        hf_raise_for_status(get_session().head(url + "config.json"))
    assert refused.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as refused:
        HfApi(endpoint=gated_hub.endpoint, token="hf_not_granted").auth_check(REPO)
    assert refused.value.response.status_code == 403
    HfApi(endpoint=gated_hub.endpoint, token=TOKEN).auth_check(REPO)


@pytest.mark.parametrize("token", [None, "hf_not_granted"])
def test_a_gated_base_without_a_granted_token_fails_naming_it_before_any_file(gated_hub, monkeypatch, token):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(PermissionError, match=rf"modelpool.models._pretrained_: '{REPO}' is a gated model.*"
                                              r"huggingface-cli login"):
        check_hub_access(SOURCE)
    assert not [r for r in gated_hub.log if "/resolve/" in r.path]
    assert [r.path for r in gated_hub.log if r.path.endswith("/auth-check")] == [f"/api/models/{REPO}/auth-check"]


def test_a_granted_token_passes_and_an_open_repository_is_not_asked_for_access(gated_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    check_hub_access(SOURCE)
    gated_hub.gated.clear()
    since = len(gated_hub.log)
    check_hub_access(SOURCE)
    assert [r.path for r in gated_hub.log[since:]] == [f"/api/models/{REPO}"]


def test_the_mirrors_llama_chat_template_opens_with_the_dated_system_turn():
    """As Llama 3.2 Instruct's own template does, with or without a system message."""
    import datetime

    from hubmirror.standins import _llama_tokenizer

    tokenizer = _llama_tokenizer()
    today = datetime.date.today().strftime("%d %b %Y")
    head = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            f"Today Date: {today}\n\n")
    user = [{"role": "user", "content": " Hi "}]
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        head + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    system = [{"role": "system", "content": "Be brief."}] + user
    assert tokenizer.apply_chat_template(system, tokenize=False).startswith(head + "Be brief.<|eot_id|>")


def test_local_files_through_datasets_builders_are_not_taken_for_hub_ids():
    """`datasets.load_dataset` of `json`, `parquet`, `imagefolder` ... over local files (the README's own-merge
    pools) names no hub repository: asking the hub for a dataset `json` would fail the run before it starts."""
    from types import SimpleNamespace

    from featcal_fusionbench.integration.hub_access import pool_sources

    local = {
        "a": {"_target_": "datasets.load_dataset", "path": "imagefolder", "data_dir": "/data/a", "split": "train"},
        "b": {"_target_": "datasets.load_dataset", "path": "parquet", "data_files": "/data/b.parquet",
              "split": "train"},
        "c": {"_target_": "featcal_fusionbench.integration.text_data.load_prompt_response", "path": "json",
              "data_files": "/data/c.jsonl", "prompt": "q", "response": "a"},
        "d": {"_target_": "datasets.load_dataset", "_args_": ["csv"], "data_files": "/data/d.csv"},
        "e": {"_target_": "datasets.load_from_disk", "dataset_path": "/data/e"},
        "hub": {"_target_": "datasets.load_dataset", "path": "ylecun/mnist", "split": "train"},
    }
    pool = SimpleNamespace(_models={}, _train_datasets=local)
    calibration = {"c": local["c"], "hub": {**local["hub"], "path": "MergeBench/math_val"}}
    assert list(pool_sources(pool, calibration)) == [
        ("modelpool.train_datasets.hub", "ylecun/mnist", "dataset"),
        ("method.calibration_datasets.hub", "MergeBench/math_val", "dataset"),
    ]
