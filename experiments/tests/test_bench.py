"""The cost benchmarks (experiments/scripts/bench_calibration.py, experiments/scripts/bench_rows.py) run end to end on a tiny model, and
the per-table time estimate adds up what the catalog's runs cost."""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from featcal_experiments.reproduce.catalog import TA8, Catalog
from featcal_experiments.reproduce.estimate import TEST_IMAGES, by_setting, eval_seconds, table_estimate

import commands  # tests/commands.py (conftest.py)

pytestmark = pytest.mark.slow  # the benchmarks run calibrations in processes of their own

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments" / "scripts"))
import bench_calibration  # noqa: E402
import bench_rows  # noqa: E402
from bench_llm_memory import ARCHS  # noqa: E402
from featcal_experiments.memory_budget import statistics_bytes  # noqa: E402
import reproduce  # noqa: E402


def test_two_point_separates_fixed_cost_from_the_per_step_cost():
    result = bench_rows.two_point(lambda k: 2.0 + 0.5 * k, 3, 9, 1000)
    assert result["fixed_seconds"] == pytest.approx(2.0)
    assert result["seconds_per_step"] == pytest.approx(0.5)
    assert result["seconds_at_target"] == pytest.approx(502.0)


def test_the_llm_memory_bench_runs_every_loading_mode_at_a_tiny_llama_shape(tmp_path):
    """experiments/scripts/bench_llm_memory.py end to end: sharded checkpoints written once, one process per loading
    mode, the figures the memory targets are stated in. The lazy and eager modes calibrate the same model; out of
    core, the merge is FusionBench's Task Arithmetic (not the checkpoint's own accumulation), so nearly the same."""
    path = tmp_path / "llm.json"
    command = [str(REPO / "experiments" / "scripts" / "bench_llm_memory.py"), "--arch", "tiny",
               "--tasks", "2", "--n", "4", "--seq-len", "16", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
               "--json", str(path)]
    done = commands.run(*command, timeout=600)  # forked; each loading mode's run is a process of its own
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(path.read_text())
    assert bench["command"].startswith("python experiments/scripts/bench_llm_memory.py") and bench["machine"]
    assert [r["mode"] for r in bench["results"]] == ["lazy", "eager", "out_of_core"]
    for result in bench["results"]:
        saved = "output_bytes" if result["mode"] == "out_of_core" else "save_peak_rss_during_bytes"
        for key in ("seconds", "forward_floor_seconds", "peak_rss_bytes", "model_bytes", "statistics_bytes", saved):
            assert result[key] > 0, key
        assert set(result["disk_bytes"]) == {"base", "expert0", "expert1", "merged"}
        assert result["peak_device_bytes"] is None
        assert result["streams"]["device_budget_bytes"] is None and result["streams"]["peak_resident_bytes"] > 0
    lazy, eager, out_of_core = bench["results"]
    # the statistics' peak is the formula's to the byte (featcal_experiments/memory_budget.py), in every mode
    assert {r["statistics_bytes"] for r in bench["results"]} == {statistics_bytes(ARCHS["tiny"], "float32")}
    # the disk the run said it needs before it wrote anything: the tensors of the 4 checkpoints (files add headers,
    # an index and configs: a few KiB each)
    overhead = sum(lazy["disk_bytes"].values()) - bench["predicted"]["disk"]["checkpoints"]
    assert 0 <= overhead <= 4 * 64 * 2**10, overhead
    assert lazy["last_block_cosine"] == eager["last_block_cosine"]
    assert out_of_core["last_block_cosine"] == pytest.approx(lazy["last_block_cosine"], abs=1e-3)
    assert out_of_core["model_bytes"] == lazy["model_bytes"]  # the tied head counted once
    index = json.loads((tmp_path / "ckpt" / "base" / "model.safetensors.index.json").read_text())["weight_map"]
    # one shard per decoder layer, one per other tensor (the embedding and the final norm; the head is tied)
    layer_shards = {shard for key, shard in index.items() if key.startswith("model.layers.")}
    other_shards = [shard for key, shard in index.items() if not key.startswith("model.layers.")]
    assert len(layer_shards) == 2 and len(other_shards) == len(set(other_shards)) == 2
    assert not layer_shards & set(other_shards)
    assert not list((tmp_path / "ckpt").glob("calibrated-*"))  # the saved copies are removed
    assert out_of_core["upstream"] == "task_arithmetic"
    # out of core after TIES: its passes over the checkpoints timed apart, the same checkpoints reused; with
    # --auto-select, a fixed-value run and then one that chooses per block, the ratios printed (two batches a task:
    # one is held out)
    done = commands.run(*command[:-1], str(tmp_path / "ties.json"), "--modes", "out_of_core", "--upstream", "ties",
                        "--auto-select", "small", "--batch-size", "2", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ties, chosen = json.loads((tmp_path / "ties.json").read_text())["results"]
    assert ties["upstream"] == "ties" and ties["upstream_passes_seconds"] > 0 and ties["output_bytes"] > 0
    assert ties["last_block_cosine"] != out_of_core["last_block_cosine"]  # another merge
    assert (ties["mode"], ties["auto_select"], ties["selection_seconds"]) == ("out_of_core", None, 0.0)
    assert (chosen["mode"], chosen["auto_select"]) == ("out_of_core+auto_select", "small")
    assert chosen["selection_seconds"] > 0 and chosen["statistics_bytes"] > ties["statistics_bytes"]
    assert chosen["last_block_cosine"] != ties["last_block_cosine"]  # its own values, per block
    assert "auto_select / fixed values, one invocation: peak RSS x" in done.stdout


def test_bench_rows_times_every_component_on_a_tiny_model(tmp_path):
    path = tmp_path / "rows.json"
    done = commands.run(str(REPO / "experiments" / "scripts" / "bench_rows.py"), "--settings", "tiny-2", "--n", "4",
                        "--steps", "1,2", "--eval-batches", "1", "--device", "cpu", "--json", str(path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(path.read_text())
    assert bench["command"].startswith("python experiments/scripts/bench_rows.py") and bench["date"] and bench["machine"]
    (out,) = bench["results"]
    assert out["setting"] == "tiny-2" and out["tasks"] == 2 and out["arch"] == "tiny"
    for key in ("eval_images_per_second", "preprocess_images_per_second_per_worker", "featcal_seconds"):
        assert out[key] > 0
    for method, target in (("surgery", 1000), ("probsurgery", 1000), ("adamerging", 1000), ("wudi", 400)):
        part = out[method]
        assert part["target_steps"] == target and all(s > 0 for s in part["seconds"])
        assert part["seconds_at_target"] == pytest.approx(part["fixed_seconds"] + target * part["seconds_per_step"])


def test_baseline_bench_trains_a_copy_and_leaves_the_merged_model_alone():
    from featcal_fusionbench.baselines import SurgeryAlgorithm

    config, base, merged, experts, images = bench_calibration.build("tiny", 2, 4)
    before = copy.deepcopy(merged.state_dict())
    options = SimpleNamespace(n=4, surgery_steps=2)
    seconds, extra = bench_calibration.run_surgery(options, config, base, merged, experts, images,
                                                   torch.device("cpu"), SurgeryAlgorithm)
    assert seconds > 0 and extra["steps"] == 2
    assert all(torch.equal(before[k], v) for k, v in merged.state_dict().items())


def test_bench_rows_rejects_a_bad_setting_before_building_anything(capsys):
    with pytest.raises(SystemExit):
        sys.argv = ["bench_rows.py", "--settings", "b32-8,vit-9", "--device", "cpu"]
        bench_rows.main()
    assert "vit-9" in capsys.readouterr().err


COMPONENT = {
    "setting": "b32-8", "eval_images_per_second": 1000.0, "preprocess_images_per_second_per_worker": 500.0,
    "featcal_seconds": 20.0,
    "surgery": {"seconds_at_target": 300.0}, "probsurgery": {"seconds_at_target": 400.0},
    "adamerging": {"seconds_at_target": 900.0}, "wudi": {"seconds_at_target": 60.0},
}


def test_eval_runs_at_the_slower_of_the_gpu_and_the_loader():
    assert eval_seconds(COMPONENT, ["mnist"]) == pytest.approx(10000 / 1000)  # 8 workers x 500 > 1000
    slow_loader = dict(COMPONENT, preprocess_images_per_second_per_worker=50.0)
    assert eval_seconds(slow_loader, ["mnist"]) == pytest.approx(10000 / 400)


def test_table_1_estimate_counts_each_upstream_once_and_every_evaluation(tmp_path):
    catalog = Catalog("hub", tmp_path)
    rows = catalog.rows("1")
    result = table_estimate(rows, {"b32-8": COMPONENT}, {"b32-8": TA8}, catalog.dependencies)
    ta8_pass = sum(TEST_IMAGES[t] for t in TA8) / 1000.0
    # 18 full passes (pretrained, 8 experts on their own tasks, 4 mergers, 12 calibrated models: 1+1+4+12)
    # plus AdaMerging's and WUDI's own stages, and 4 of each calibrator (one per upstream merger)
    expected = 18 * ta8_pass + 900 + 60 + 4 * (20 + 300 + 400)
    assert len(result["run_seconds"]) == 1 + 8 + 4 + 12
    assert result["total_seconds"] == pytest.approx(expected)
    assert result["missing_settings"] == []


def test_estimate_flag_prints_each_table_and_names_unmeasured_settings(tmp_path, capsys):
    bench = tmp_path / "rows.json"
    bench.write_text(json.dumps({"machine": "m", "date": "d", "command": "c", "results": [COMPONENT, dict(COMPONENT, setting="l14-20")]}))
    assert set(by_setting(json.loads(bench.read_text()))) == {"b32-8", "l14-20"}
    assert reproduce.main(["--table", "1,2,3", "--estimate", str(bench), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "table 1: " in out and "over 25 runs" in out
    assert "table 2: incomplete" in out and "no components for b32-14, b32-20, l14-14, l14-8" in out
    assert "table 3: not estimated" in out
    with pytest.raises(SystemExit):
        reproduce.main(["--table", "1", "--estimate", str(tmp_path / "missing.json")])
