"""FeatCalAlgorithm through FusionBench's model pool, in process."""

import copy

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from transformers import CLIPVisionModel

from featcal_fusionbench import FeatCalAlgorithm
from featcal_fusionbench.integration.algorithm import REPORT_NAME
from featcal_fusionbench.core.sampling import calibration_indices
from fusion_bench.method import TaskArithmeticAlgorithm
from fusion_bench.utils import instantiate

from helpers import tiny_clip_vision

TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


class SpyUpstream:
    """An upstream merger that records whether it ran."""

    def __init__(self):
        self.ran = False

    def run(self, modelpool):
        self.ran = True
        return TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(modelpool)


def load_pool(toy_world):
    return instantiate(OmegaConf.load(toy_world["modelpool"]))


def make(tmp_path=None, **kwargs):
    kwargs.setdefault("upstream", TA)
    kwargs.setdefault("num_calibration_examples", 16)
    kwargs.setdefault("batch_size", 8)
    algo = FeatCalAlgorithm(**kwargs)
    loggers = [L.fabric.loggers.CSVLogger(str(tmp_path))] if tmp_path is not None else None
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1, loggers=loggers)
    return algo


def test_returns_the_merged_models_class_keys_and_shapes(toy_world, tmp_path):
    pool = load_pool(toy_world)
    calibrated = make(tmp_path).run(pool)
    reference = pool.load_pretrained_model()
    assert type(calibrated) is CLIPVisionModel
    ref_state, state = reference.state_dict(), calibrated.state_dict()
    assert list(state) == list(ref_state)
    assert all(state[k].shape == v.shape for k, v in ref_state.items())
    assert list(tmp_path.rglob(REPORT_NAME)), "the calibration report is written to the log dir"


def test_return_upstream_gives_both_models_and_the_upstream_is_task_arithmetic(toy_world):
    pool = load_pool(toy_world)
    result = make(return_upstream=True).run(pool)
    assert set(result) == {"upstream", "featcal", "featcal_calibration"}
    ta = TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(load_pool(toy_world))
    for (name, p), q in zip(result["upstream"].named_parameters(), ta.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    changed = [n for (n, p), q in zip(result["featcal"].named_parameters(), ta.parameters()) if not torch.equal(p.cpu(), q)]
    assert any("encoder.layers" in n for n in changed)
    assert result["featcal_calibration"]["seconds"] > 0


def test_merged_model_from_the_pool_and_from_a_saved_path_give_the_same_result(toy_world, tmp_path):
    ta = TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(load_pool(toy_world))
    pool = load_pool(toy_world)
    pool.add_model("_merged_", copy.deepcopy(ta))
    from_pool = make(upstream=None).run(pool)
    ta.save_pretrained(tmp_path / "merged")
    from_path = make(upstream=None, merged_model_path=str(tmp_path / "merged")).run(load_pool(toy_world))
    from_method = make().run(load_pool(toy_world))
    for a, b, c in zip(from_pool.parameters(), from_path.parameters(), from_method.parameters()):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lambda_": 0.0}, "lambda_ must be > 0"),
        ({"lambda_": -1.0}, "lambda_ must be > 0"),
        ({"alpha": -0.1}, r"alpha must lie in \[0, 1\]"),
        ({"alpha": 1.5}, r"alpha must lie in \[0, 1\]"),
        ({"num_calibration_examples": 0}, "num_calibration_examples must be >= 1"),
        ({"accumulation_dtype": "float16"}, "accumulation_dtype must be one of"),
        ({"module_regex": "("}, "not a valid regular expression"),
    ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatCalAlgorithm(**kwargs)


def _expect_early_failure(pool, message, tmp_path, **kwargs):
    spy = SpyUpstream()
    with pytest.raises(ValueError, match=message):
        make(tmp_path, upstream=spy, **kwargs).run(pool)
    assert not spy.ran, "the upstream merge must not start when the input is bad"
    assert not list(tmp_path.rglob(REPORT_NAME))


def test_missing_pretrained_fails_before_the_upstream_runs(toy_world, tmp_path):
    pool = load_pool(toy_world)
    del pool._models["_pretrained_"]
    _expect_early_failure(pool, "`_pretrained_`", tmp_path)


@pytest.mark.parametrize("upstream, message", [
    ({"_target_": "fusion_bench.method.SimpleEnsembleAlgorithm"}, "SimpleEnsembleAlgorithm returns an ensemble"),
    ({"_target_": "fusion_bench.method.SmileUpscalingAlgorithm", "device": "cpu"}, "an upscaled model"),
    ({"name": "clip_layer_wise_adamerging"}, "has no `_target_`"),
])
def test_an_upstream_that_does_not_return_one_merged_model_is_refused_before_anything_runs(
        toy_world, tmp_path, monkeypatch, upstream, message):
    """FusionBench's configs of MoE upscaling, ensembles, training, pruning or analysis (and its older `name:`
    configs, which nothing instantiates) are refused by their class, before a model is loaded; instantiated (as
    the CLI does) or as a config."""
    from featcal_fusionbench.integration import upstream as upstream_module

    pool = load_pool(toy_world)
    loads = []
    monkeypatch.setattr(type(pool), "load_model", lambda self, *a, **k: loads.append(a) or None)
    given = OmegaConf.create(upstream)
    with pytest.raises(ValueError, match=message):
        make(tmp_path, upstream=given).run(pool)
    if "_target_" in upstream and len(upstream) == 1:
        with pytest.raises(ValueError, match=message):
            make(tmp_path, upstream=instantiate(given)).run(pool)
    assert not loads and not list(tmp_path.rglob(REPORT_NAME))
    assert upstream_module.upstream_class_name(given) in (None, *upstream_module.NOT_ONE_MERGED_MODEL)
    # with the merged model given, the upstream is not run: nothing to refuse
    assert upstream_module.check_upstream_merger(None, "FeatCal") is None


@pytest.mark.parametrize(
    "odd, message",
    [
        (dict(hidden=16, layers=2), r"expert 'odd' has a different shape for vision_model\."),
        (dict(hidden=32, layers=3), r"expert 'odd' has different parameters .*unexpected: \['vision_model\.encoder\.layers\.2"),
    ],
)
def test_expert_with_another_architecture_is_named(toy_world, tmp_path, odd, message):
    pool = load_pool(toy_world)
    pool.add_model("odd", tiny_clip_vision(**odd))
    pool._train_datasets["odd"] = pool._train_datasets["toy_0"]
    _expect_early_failure(pool, message, tmp_path)


def test_task_without_train_split_is_named(toy_world, tmp_path):
    pool = load_pool(toy_world)
    del pool._train_datasets["toy_1"]
    _expect_early_failure(pool, r"\['toy_1'\] have no calibration examples: the model pool has no train split", tmp_path)


def test_calibration_datasets_stand_in_for_a_missing_train_split(toy_world):
    """FusionBench's FLAN-T5 pools carry no train splits: a dataset config per task supplies them."""
    pool = load_pool(toy_world)
    config = copy.deepcopy(OmegaConf.load(toy_world["modelpool"]).train_datasets["toy_1"])
    del pool._train_datasets["toy_1"]
    reference = make(upstream=TA).run(load_pool(toy_world))
    calibrated = make(upstream=TA, calibration_datasets={"toy_1": config, "unused_task": config}).run(pool)
    for (name, p), q in zip(calibrated.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_too_few_examples_says_how_many(toy_world, tmp_path):
    _expect_early_failure(
        load_pool(toy_world), "task 'toy_0' has only 64 train examples, fewer than num_calibration_examples=65",
        tmp_path, num_calibration_examples=65,
    )


def test_no_upstream_source_is_an_error(toy_world, tmp_path):
    with pytest.raises(ValueError, match="no upstream merged model"):
        make(tmp_path, upstream=None).run(load_pool(toy_world))


def test_calibration_examples_are_seeded_per_task_name():
    a = calibration_indices(1000, 16, seed=42, task="mnist")
    assert a == calibration_indices(1000, 16, seed=42, task="mnist")
    assert len(set(a)) == 16 and all(0 <= i < 1000 for i in a)
    assert a != calibration_indices(1000, 16, seed=43, task="mnist")
    assert a != calibration_indices(1000, 16, seed=42, task="svhn")


def test_the_old_patch_weight_flag_still_works_with_a_warning_naming_the_new_option():
    with pytest.warns(FutureWarning, match="method.family_options.last_block_patch_token_weight"):
        algo = FeatCalAlgorithm(upstream=TA, last_block_patch_token_weight=0.01)
    assert algo.family_options == {"last_block_patch_token_weight": 0.01}
    with pytest.raises(ValueError, match="contradicts family_options"):
        FeatCalAlgorithm(upstream=TA, last_block_patch_token_weight=0.01, family_options={"last_block_patch_token_weight": 1.0})


def test_a_family_option_no_family_knows_fails_at_construction_and_one_the_models_family_lacks_before_the_upstream(
    toy_world,
):
    with pytest.raises(ValueError, match="not an option of any model family.*last_block_patch_token_weight"):
        FeatCalAlgorithm(upstream=TA, family_options={"no_such_option": 1})
    spy = SpyUpstream()
    with pytest.raises(ValueError, match="last_block_patch_token_weight must be a finite number >= 0"):
        make(upstream=spy, family_options={"last_block_patch_token_weight": -1}).run(load_pool(toy_world))
    assert not spy.ran



def test_a_bad_calibration_dataset_fails_before_any_model_is_loaded(toy_world, tmp_path, monkeypatch):
    """A field missing from a calibration dataset is named before the base, the experts or the merge are loaded."""
    pool = load_pool(toy_world)
    loaded = []
    monkeypatch.setattr(type(pool), "load_model", lambda self, *a, **k: loaded.append(a) or 1 / 0)
    bad = {"_target_": "featcal_fusionbench.integration.text_data.prompt_response",
           "rows": {"_target_": "datasets.Dataset.from_dict", "mapping": {"instruction": ["a"]}},
           "prompt": "instruction", "response": "output"}
    _expect_early_failure(pool, r"no field\(s\) \['output'\]", tmp_path, calibration_datasets={"toy_1": bad})
    assert loaded == []
