"""scripts/gpu_check.sh and its steps (experiments/scripts/gpu_check.py): on a machine without CUDA the command says
so in one line and exits 2; its CPU dry run (tiny shapes) runs every step and writes the summaries, so that the
command a lent GPU will run cannot rot meanwhile."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

import commands  # tests/commands.py (conftest.py)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")
@pytest.mark.parametrize("extra", [[], ["--llama70b"]], ids=["default", "llama70b"])
def test_without_cuda_the_check_says_so_in_one_line_and_exits_2(tmp_path, extra):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was checked"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_dry_run_runs_every_step_at_tiny_shapes_and_writes_its_summaries(tmp_path):
    out = tmp_path / "out"
    done = commands.run(str(REPO / "experiments" / "scripts" / "gpu_check.py"), "--device", "cpu", "--out", str(out),
                        "--llama70b", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps) == ["tests", "clip", "llm", "llm70b"] and summary["failed"] == []
    assert all(step["returncode"] == 0 for step in steps.values())
    if not torch.cuda.is_available():  # every CUDA test reports itself skipped, none vanished
        assert set(steps["tests"]["counts"]) == {"skipped"} and steps["tests"]["counts"]["skipped"] >= 6
    for name in ("clip", "llm", "llm70b"):
        figures = steps[name]["figures"]
        assert figures["seconds"] > 0 and figures["forward_floor_seconds"] > 0 and figures["peak_rss_bytes"] > 0
    assert summary["machine"]["device"] == "cpu" and summary["seconds"] > 0
    text = (out / "gpu_check.md").read_text()
    assert "| tests: " in text and "| clip: " in text and "| llm: " in text and "skipped" in text
    assert {p.name for p in out.iterdir()} >= {"gpu_check.json", "gpu_check.md", "clip_tiny.json", "llm_tiny.json",
                                           "llm70b_tiny.json"}
    assert not (out / "work").exists()  # the benches' checkpoints are removed
    # the 70B step's dry run passes the GPU run's own options (its shape aside), so a bad one fails here first
    llm70b = json.loads((out / "llm70b_tiny.json").read_text())
    assert (llm70b["dtype"], llm70b["storage_dtype"], llm70b["accumulation_dtype"]) == ("bfloat16", "bfloat16", "float32")
    assert "--profile" in llm70b["command"].split() and llm70b["results"][0]["phase_seconds"]
