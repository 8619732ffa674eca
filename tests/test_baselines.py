"""Surgery and ProbSurgery after an upstream merger, on the toy world and on tiny models."""

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from featcal_fusionbench import ProbSurgeryAlgorithm, SurgeryAlgorithm
from featcal_fusionbench.baselines import ProbSurgeryModelWrapper, SurgeryModelWrapper
from fusion_bench.utils import instantiate

from helpers import tiny_clip_vision

TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}
METHODS = [SurgeryAlgorithm, ProbSurgeryAlgorithm]


def load_pool(toy_world):
    return instantiate(OmegaConf.load(toy_world["modelpool"]))


def load_taskpool(toy_world, fabric):
    taskpool = instantiate(OmegaConf.load(toy_world["taskpool"]))
    taskpool._fabric_instance = fabric
    return taskpool


def make(cls, **kwargs):
    kwargs.setdefault("upstream", TA)
    kwargs.setdefault("num_calibration_examples", 16)
    kwargs.setdefault("max_steps", 3)
    kwargs.setdefault("batch_size", 8)
    algo = cls(**kwargs)
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    return algo


def accuracies(report):
    return {t: v["accuracy"] for t, v in report.items() if isinstance(v, dict) and "accuracy" in v}


@pytest.mark.parametrize("wrapper_cls", [SurgeryModelWrapper, ProbSurgeryModelWrapper])
def test_untrained_wrapper_leaves_features_unchanged(wrapper_cls):
    wrapper = wrapper_cls(tiny_clip_vision(), ["a-task", "b"], projection_dim=16).eval()
    features = torch.nn.functional.normalize(torch.randn(5, 16), dim=-1)
    for task in ("a-task", "b"):
        mapped, original, _ = wrapper.compute_surgery_features(features, task)
        assert torch.equal(mapped, features) and torch.equal(original, features)


@pytest.mark.parametrize("cls", METHODS)
def test_zero_steps_evaluate_exactly_like_the_upstream_model(cls, toy_world):
    """Through FusionBench's task pool and its surgery hook: at step 0 the wrapper is the merged model."""
    algo = make(cls, max_steps=0, return_upstream=True)
    out = algo.run(load_pool(toy_world))
    key = cls.method_name.lower()
    assert out[key].is_surgery_model
    taskpool = load_taskpool(toy_world, algo.fabric)
    assert accuracies(taskpool.evaluate(out[key])) == accuracies(taskpool.evaluate(out["upstream"]))


@pytest.mark.parametrize("cls", METHODS)
def test_loss_decreases_on_a_fixed_batch(cls):
    torch.manual_seed(0)
    algo = cls()
    wrapper = algo.build_wrapper(tiny_clip_vision(), ["t"], 16)
    features = torch.nn.functional.normalize(torch.randn(16, 16), dim=-1)
    target = torch.nn.functional.normalize(features + 0.3 * torch.randn(16, 16), dim=-1)
    optimizer = torch.optim.Adam(wrapper.collect_trainable_params(), lr=1e-3)
    wrapper.train()
    losses = []
    for _ in range(300):
        loss = algo.loss(wrapper, features, target, "t")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.8 * sum(losses[:20]) / 20


@pytest.mark.parametrize("cls", METHODS)
def test_same_seed_gives_the_same_weights_and_another_seed_does_not(cls, toy_world):
    weights = [make(cls, seed=s).run(load_pool(toy_world)).state_dict() for s in (7, 7, 8)]
    trained = [k for k in weights[0] if not k.startswith("model.")]
    assert trained
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in trained)
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in trained)


def test_probsurgery_evaluation_is_deterministic(toy_world):
    algo = make(ProbSurgeryAlgorithm, max_steps=5)
    wrapper = algo.run(load_pool(toy_world))
    assert not wrapper.training
    taskpool = load_taskpool(toy_world, algo.fabric)
    first = taskpool.evaluate(wrapper)
    assert {t: v["loss"] for t, v in first.items() if "loss" in v} == {
        t: v["loss"] for t, v in taskpool.evaluate(wrapper).items() if "loss" in v
    }


@pytest.mark.parametrize("split, precompute, mode", [("test", False, "streamed"), ("train", True, "precomputed"),
                                                     ("train", "replay", "replayed")])
def test_split_and_feature_mode_are_reported(toy_world, tmp_path, split, precompute, mode):
    algo = make(SurgeryAlgorithm, calibration_split=split, precompute_features=precompute)
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1, loggers=[L.fabric.loggers.CSVLogger(str(tmp_path))])
    algo.run(load_pool(toy_world))
    import json

    report = json.loads(next(tmp_path.rglob("surgery_report.json")).read_text())
    assert report["calibration_split"] == split
    assert report["features"] == mode
    assert report["upstream"] == "method:fusion_bench.method.TaskArithmeticAlgorithm"


@pytest.mark.parametrize("cls", METHODS)
def test_replayed_features_train_the_maps_that_streamed_ones_train(cls, toy_world):
    """precompute_features=replay serves features computed once in the streamed run's own batches: 12 examples in
    batches of 8 (the last 4 dropped, a fresh shuffle each epoch) over 6 steps train the same maps, to float
    rounding; resampled precomputed features (true) draw other batches and do not."""
    def trained(mode):
        weights = make(cls, num_calibration_examples=12, max_steps=6, precompute_features=mode).run(
            load_pool(toy_world)).state_dict()
        return {k: v for k, v in weights.items() if not k.startswith("model.")}

    streamed, replayed, resampled = trained(False), trained("replay"), trained(True)
    assert streamed and streamed.keys() == replayed.keys() == resampled.keys()
    distance = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    assert distance(streamed, replayed) < 1e-6 < 1e-4 < distance(streamed, resampled)


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_calibration_examples": 0}, "num_calibration_examples must be an integer >= 1"),
        ({"max_steps": -1}, "max_steps must be an integer >= 0"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"calibration_split": "val"}, "calibration_split must be one of"),
        ({"precompute_features": "replayed"}, "precompute_features must be false, true or replay, got 'replayed'"),
    ],
)
def test_bad_arguments_fail_at_construction(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("cls", METHODS)
def test_pool_without_experts_is_an_error(cls, toy_world):
    pool = load_pool(toy_world)
    for name in list(pool.model_names):
        del pool._models[name]
    with pytest.raises(ValueError, match="no expert models"):
        make(cls).run(pool)


def test_too_few_test_examples_for_test_time_adaptation_say_how_many(toy_world):
    with pytest.raises(ValueError, match="has only 32 test examples, fewer than num_calibration_examples=33"):
        make(SurgeryAlgorithm, calibration_split="test", num_calibration_examples=33).run(load_pool(toy_world))


@pytest.mark.parametrize("cls", METHODS)
def test_a_vision_only_base_checkpoint_is_named_before_any_expert_loads(cls, toy_world, tmp_path, monkeypatch):
    """Their feature site needs CLIP's visual projection, which a CLIPVisionModel checkpoint does not hold; FeatCal
    runs on such a pool (its experts are vision-only too)."""
    from transformers import CLIPVisionModel

    vision_only = tmp_path / "vision_only"
    CLIPVisionModel.from_pretrained(toy_world["root"] / "pretrained").save_pretrained(vision_only)
    pool = load_pool(toy_world)
    pool._models["_pretrained_"] = str(vision_only)
    loaded, load_model = [], type(pool).load_model

    def recording(self, name, *args, **kwargs):
        loaded.append(name)
        return load_model(self, name, *args, **kwargs)

    monkeypatch.setattr(type(pool), "load_model", recording)
    with pytest.raises(ValueError, match=r"`models._pretrained_` \(.*vision_only\) is a 'clip_vision_model' checkpoint"):
        make(cls).run(pool)
    assert loaded == ["_pretrained_"]  # no expert
