"""experiments/scripts/mergekit_merge.py without mergekit: the YAML it hands mergekit-yaml, the config it repairs, and
what it refuses before mergekit runs (mergekit itself lives in a venv of its own, not in CI)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "scripts" / "mergekit_merge.py"


def script():
    spec = importlib.util.spec_from_file_location("mergekit_merge", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_yaml_names_the_base_and_every_expert_with_their_parameters(tmp_path):
    merge = script()
    experts = [tmp_path / "experts" / e for e in ("math", "code", "instruction")]
    ties = yaml.safe_load(merge.config_yaml("ties", tmp_path / "pretrained", experts, 0.5, 1.0, 0.3))
    assert ties["merge_method"] == "ties" and ties["base_model"] == str(tmp_path / "pretrained")
    assert [m["model"] for m in ties["models"]] == [str(e) for e in experts]
    assert all(m["parameters"] == {"weight": 1.0, "density": 0.5} for m in ties["models"])
    assert ties["parameters"] == {"lambda": 0.3} and ties["dtype"] == ties["out_dtype"] == "float32"
    arithmetic = yaml.safe_load(merge.config_yaml("task_arithmetic", tmp_path / "b", experts, 0.5, 0.3, 1.0))
    assert all(m["parameters"] == {"weight": 0.3} for m in arithmetic["models"]) and "parameters" not in arithmetic


def test_rope_theta_is_written_back_where_transformers_4_reads_it(tmp_path):
    merge = script()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}))
    merge.restore_rope_theta(config)
    assert json.loads(config.read_text())["rope_theta"] == 100000.0


def test_a_missing_world_or_venv_is_named_before_anything_runs(tmp_path):
    run = [sys.executable, str(SCRIPT), "--world", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode != 0 and "featcal-world build llm" in done.stderr
    for model in ("pretrained", "experts/math", "experts/code", "experts/instruction"):
        (tmp_path / "world" / model).mkdir(parents=True)
        (tmp_path / "world" / model / "config.json").write_text("{}")
    run[3] = str(tmp_path / "world")
    done = subprocess.run([*run, "--venv", str(tmp_path / "no-venv")], capture_output=True, text=True)
    assert done.returncode != 0 and "bash experiments/scripts/mergekit_setup.sh" in done.stderr
    assert not (tmp_path / "out").exists()
