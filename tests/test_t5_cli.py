"""FeatCal, Surgery and ProbSurgery on tiny T5 experts through the `fusion_bench` CLI, offline."""

import json

import pytest
import torch

from featcal_fusionbench.baselines.modules import SurgeryModelWrapper
from featcal_fusionbench.models.task_switch import LMHeadSurgery
from featcal_fusionbench.evaluation.text_taskpool import active_task

from helpers import tiny_t5
from test_cli import fusion_bench


def t5_args(pool, *extra):
    return [
        "--config-dir", pool["config_dir"],
        "modelpool=Seq2SeqLMPool/tiny_t5",
        "taskpool=tiny_t5_text",
        "method.num_calibration_examples=8",
        "method.return_upstream=true",
        *extra,
    ]


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
def test_featcal_for_flan_t5_runs_offline_and_reports_the_average(tiny_t5_pool, tmp_path):
    """The GLUE config's calibration_datasets list only glue-* tasks: this pool's own train splits are used."""
    fusion_bench(*t5_args(tiny_t5_pool, "method=featcal/flan_t5_ta", f"path.log_dir={tmp_path}"), cwd=tmp_path)
    report = json.loads((tmp_path / "program_report.json").read_text())
    assert set(report) >= {"upstream", "featcal", "featcal_calibration"}
    for model in ("upstream", "featcal"):
        assert set(report[model]) >= {*tiny_t5_pool["tasks"], "average"}
        scores = [report[model][t]["accuracy"] for t in tiny_t5_pool["tasks"]]
        assert report[model]["average"]["score"] == pytest.approx(sum(scores) / len(scores))
    calibration = json.loads((tmp_path / "featcal_report.json").read_text())
    assert calibration["family"] == "t5"
    stacks = [b["modules"][0].split(".")[0] for b in calibration["blocks"]]
    assert stacks == ["encoder", "encoder", "decoder", "decoder"]
    assert calibration["hparams"]["calibrate_layernorm"] is False
    assert not any("layer_norm" in m for b in calibration["blocks"] for m in b["modules"])


@pytest.mark.slow  # the fusion_bench CLI in a process of its own
@pytest.mark.parametrize("method", ["surgery", "probsurgery"])
def test_surgery_baselines_for_flan_t5_run_offline(tiny_t5_pool, tmp_path, method):
    fusion_bench(
        *t5_args(tiny_t5_pool, f"method={method}/flan_t5_ta", "method.max_steps=3", f"path.log_dir={tmp_path}"),
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "program_report.json").read_text())
    assert "average" in report[method]
    assert report[f"{method}_calibration"]["calibration_split"] == "train"


def test_replayed_features_are_refused_where_the_rows_are_tokens(tiny_t5_pool):
    """T5's rows are target tokens, not examples: refused when the feature site is known, before any expert loads."""
    from pathlib import Path

    import lightning as L
    from fusion_bench.utils import instantiate
    from omegaconf import OmegaConf

    from featcal_fusionbench import SurgeryAlgorithm

    pool = instantiate(OmegaConf.load(Path(tiny_t5_pool["config_dir"], "modelpool", "Seq2SeqLMPool", "tiny_t5.yaml")))
    algo = SurgeryAlgorithm(upstream={"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3},
                            num_calibration_examples=8, precompute_features="replay")
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    loaded = []
    pool.load_model = lambda name, *a, **k: loaded.append(name) or type(pool).load_model(pool, name, *a, **k)
    with pytest.raises(ValueError, match="replay serves one feature row per example, and the t5 family's site has one "
                                         "per token: use true or false"):
        algo.run(pool)
    assert not [name for name in loaded if name != "_pretrained_"]  # no expert was loaded


def test_lm_head_surgery_applies_only_the_active_tasks_map():
    model = tiny_t5()
    maps = SurgeryModelWrapper(model, ["a", "b"], projection_dim=model.config.d_model, hidden_dim=4)
    with torch.no_grad():
        getattr(maps, "feature_mapping_to_head_up_proj_a").weight.normal_()
    deployed = LMHeadSurgery(maps)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 1]]), "decoder_input_ids": torch.tensor([[0, 9, 4]])}
    with torch.no_grad():
        plain = model(**inputs).logits
        with active_task(deployed, "b"):  # zero-initialised up-projection: the identity
            torch.testing.assert_close(deployed(**inputs).logits, plain)
        with active_task(deployed, "a"):
            assert not torch.allclose(deployed(**inputs).logits, plain)
        assert deployed.active_task is None
        torch.testing.assert_close(deployed(**inputs).logits, plain)
