"""A real kill: a `fusion_bench` out-of-core run (auto_select on) SIGKILLed once block 0's shard is recorded, then
the same command again resumes at block 1 and ends bit for bit as a run never stopped."""

import json
import os
import signal
import subprocess
import time

import pytest
from safetensors.torch import load_file
from commands import BIN, OFFLINE
from test_cli import fusion_bench, toy_args

pytestmark = pytest.mark.slow  # three fusion_bench processes

# Loaded by every Python process started with this folder on PYTHONPATH: each recorded block is followed by a pause,
# so that the test can kill the run between two blocks (the pause is the test's, not the product's).
SLOW_BLOCKS = """
import os, time
from featcal_fusionbench.models import checkpoint_writer

_write_block = checkpoint_writer.CheckpointWriter.write_block


def write_block(self, *args, **kwargs):
    _write_block(self, *args, **kwargs)
    time.sleep(float(os.environ["FEATCAL_TEST_BLOCK_PAUSE"]))


checkpoint_writer.CheckpointWriter.write_block = write_block
"""


def tensors(folder):
    return {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


def test_a_sigkilled_out_of_core_run_resumes_bit_for_bit(toy_world, tmp_path):
    from featcal_fusionbench.models.checkpoint_writer import partial_folder, read_progress

    def command(output, log_dir):
        return toy_args(toy_world, "method=featcal", "method.out_of_core=true", "method.auto_select=true",
                        f"merged_model_save_path={output}", f"path.log_dir={log_dir}")

    fusion_bench(*command(tmp_path / "reference", tmp_path / "log-reference"), cwd=tmp_path)

    out, log_dir = tmp_path / "calibrated", tmp_path / "log"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_BLOCKS)
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(hooks), "FEATCAL_TEST_BLOCK_PAUSE": "30"}
    run = subprocess.Popen([str(BIN / "fusion_bench"), *command(out, log_dir)], cwd=tmp_path, env=env, process_group=0,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = partial_folder(out)
    deadline = time.time() + 300
    try:
        while run.poll() is None and time.time() < deadline:
            progress = read_progress(partial) if (partial / "featcal_progress.json").is_file() else None
            if progress and progress["blocks"]:
                break
            time.sleep(0.2)
        assert run.poll() is None, "the run ended before its first block was recorded"
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode == -signal.SIGKILL
    assert sorted(read_progress(partial)["blocks"]) == ["0"]
    assert not out.exists(), "the partial output was put in place of a finished model"

    fusion_bench(*command(out, log_dir), cwd=tmp_path)
    reference, resumed = tensors(tmp_path / "reference"), tensors(out)
    assert reference.keys() == resumed.keys()
    assert [k for k in reference if not (reference[k] == resumed[k]).all()] == []
    report = json.loads((log_dir / "featcal_report.json").read_text())
    assert report["resumed_blocks"] == [0]
    first = json.loads((tmp_path / "log-reference" / "featcal_report.json").read_text())
    assert report["auto_select"]["choice"] == first["auto_select"]["choice"], "the kept choice is the one made"
    assert not partial.exists()
