"""The OpenCLIP vision family against the HF CLIP family on the same network, its QuickGELU check, its batches and
its layer-scale solve. (The family contract, tests/test_family_contract.py, runs it as well.)"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from omegaconf import OmegaConf
from PIL import Image

from featcal_fusionbench.models.openclip_convert import hf_to_openclip, openclip_to_hf_state
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.families import family_for
from featcal_fusionbench.families.clip_vision import CLIPVisionFamily
from featcal_fusionbench.families.openclip_vision import (
    OpenCLIPVisionFamily,
    activation_mismatch,
    trained_with_quick_gelu,
)
from featcal_fusionbench.core.hparams import FeatCalHParams

import featcal_fusionbench.integration.openclip_pools  # noqa: F401 - FusionBench's OpenCLIP pool imports on Python < 3.12
from fusion_bench.modelpool import OpenCLIPVisionModelPool  # noqa: E402

from helpers import tiny_clip_vision, tiny_image_encoder, tiny_openclip_world, tiny_world


def test_a_converted_hf_tower_computes_the_same_features():
    """HF's q/k/v are rows of open_clip's in_proj, fc1/fc2 its c_fc/c_proj, visual_projection its proj transposed:
    the image features agree to float32 rounding, and a GELU tower (the wrong activation) does not."""
    hf = tiny_clip_vision(seed=3)
    projection = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    tower = hf_to_openclip(hf, projection)
    assert family_for(tower).name == "openclip_vision"
    images = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(pixel_values=images).pooler_output @ projection.t()
        torch.testing.assert_close(tower(images), expected, rtol=1e-5, atol=1e-5)
        wrong = copy.deepcopy(tower)
        for block in wrong.transformer.resblocks:
            block.mlp.gelu = torch.nn.GELU()
        assert not torch.allclose(wrong(images), expected, rtol=1e-3, atol=1e-3)
    back = tiny_clip_vision(seed=4)
    back.load_state_dict(openclip_to_hf_state(tower), strict=True)
    for (name, p), q in zip(back.state_dict().items(), hf.state_dict().values()):
        assert torch.equal(p, q), name


def calibrate(family, merged, base, experts, data):
    hp = FeatCalHParams(num_calibration_examples=12, batch_size=4, accumulation_dtype="float64")
    report = FeatCalEngine(family, hp, "cpu", progress=False).run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    return merged, report


@pytest.mark.parametrize("patch_weight", [1.0, 0.01])
def test_featcal_through_either_family_calibrates_the_same_parameters(patch_weight):
    """One network, two libraries: FeatCal through clip_vision (HF) and through openclip_vision (the converted
    towers) on the same images gives the same calibrated weights, mapped back to HF names, with the same
    last-block token weighting option."""
    base, experts, merged, data = tiny_world()
    options = {"last_block_patch_token_weight": patch_weight}
    convert = lambda m: hf_to_openclip(m)  # noqa: E731
    towers = [convert(m) for m in (merged, base, *experts.values())]
    hf_calibrated, hf_report = calibrate(CLIPVisionFamily(**options), copy.deepcopy(merged), base, experts, data)
    oc_calibrated, oc_report = calibrate(
        OpenCLIPVisionFamily(**options), towers[0], towers[1], dict(zip(experts, towers[2:])), data
    )
    assert sum(len(b["modules"]) for b in oc_report["blocks"]) == sum(len(b["modules"]) for b in hf_report["blocks"])
    got = openclip_to_hf_state(oc_calibrated)
    expected, before = hf_calibrated.state_dict(), merged.state_dict()
    moved = 0
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=2e-5, msg=key)
        moved += not torch.allclose(expected[key], before[key], rtol=1e-4, atol=1e-4)
    assert moved >= 3 * 10  # every block's linears and norms moved: the comparison is not merged == merged


def test_the_quickgelu_pitfall_is_named_with_its_fix():
    assert trained_with_quick_gelu("ViT-B-32") is True  # FusionBench's ImageEncoder: the OpenAI weights
    assert trained_with_quick_gelu("ViT-B-32-quickgelu") is True
    assert trained_with_quick_gelu("ViT-B-32__pretrained__laion2b_s34b_b79k") is False
    assert trained_with_quick_gelu("ViT-B-32__init__") is None
    gelu, quick = (tiny_image_encoder(quick_gelu=q).model.visual for q in (False, True))
    entry = {"model_name": "ViT-B-32", "pickle_path": "zeroshot.pt"}
    message = activation_mismatch(entry, gelu)
    assert "GELU" in message and "trained with QuickGELU" in message and "Fix:" in message
    assert activation_mismatch(entry, quick) is None
    assert "trained with GELU" in activation_mismatch({"model_name": "ViT-B-32__pretrained__laion2b_s34b_b79k"}, quick)
    assert activation_mismatch("a/pickled/encoder.pt", gelu) is None  # a pickle keeps the modules it was saved with


def test_featcal_refuses_a_gelu_pool_of_quickgelu_checkpoints_before_merging(tmp_path, monkeypatch):
    """FusionBench's pool rebuilds each `{model_name, state_dict_path}` entry with ImageEncoder(model_name), which
    open_clip 3.x builds with nn.GELU: simulated offline with a tiny GELU encoder, the run stops before the merge."""
    import fusion_bench.modelpool.openclip_vision.modelpool as pool_module

    from featcal_fusionbench import FeatCalAlgorithm

    base = tiny_image_encoder(quick_gelu=False)
    torch.save(base.state_dict(), tmp_path / "weights.pt")
    monkeypatch.setattr(pool_module, "ImageEncoder", lambda name: tiny_image_encoder(quick_gelu=False))
    entry = {"model_name": "ViT-B-32", "state_dict_path": str(tmp_path / "weights.pt")}
    # calibration data are loaded (and checked) before any model: real ones, so that the model check is reached
    pictures = [Image.fromarray((torch.rand(16, 16, 3) * 255).byte().numpy()) for _ in range(4)]
    Dataset.from_dict({"image": pictures, "label": [0, 1, 0, 1]}).save_to_disk(str(tmp_path / "data"))
    data = {"_target_": "datasets.load_from_disk", "dataset_path": str(tmp_path / "data")}
    pool = OpenCLIPVisionModelPool(
        OmegaConf.create({"_pretrained_": entry, "a": entry, "b": entry}),
        train_datasets=OmegaConf.create({"a": data, "b": data}),
    )
    upstream = {"_target_": "fusion_bench.method.SimpleAverageAlgorithm"}
    algorithm = FeatCalAlgorithm(upstream=upstream, num_calibration_examples=4)
    monkeypatch.setattr(type(algorithm), "load_merged", lambda *a: pytest.fail("the merge ran"))
    with pytest.raises(ValueError, match=r"pool entry '_pretrained_'.*GELU.*trained with QuickGELU.*Fix"):
        algorithm.run(pool)


def test_calibration_images_go_through_the_encoders_evaluation_transform():
    encoder = tiny_image_encoder()
    pool = OpenCLIPVisionModelPool(OmegaConf.create({}))
    pool.add_model("_pretrained_", encoder)
    g = torch.Generator().manual_seed(0)
    pictures = [Image.fromarray((torch.rand(24, 20, 3, generator=g) * 255).byte().numpy()) for _ in range(5)]
    dataset = Dataset.from_dict({"image": pictures, "label": [0, 1, 0, 1, 0]})
    batches = list(OpenCLIPVisionFamily().batches(pool, dataset, batch_size=2))
    assert [b.shape for b in batches] == [(2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16)]
    torch.testing.assert_close(batches[0][1], encoder.val_preprocess(pictures[1]))
    with pytest.raises(TypeError, match="test_processor"):
        OpenCLIPVisionFamily().batches(object(), dataset, batch_size=2)


def test_layer_scale_is_solved_as_a_scale_of_its_own_input():
    """An independent solve of ls_2 in the last block: gamma = (sum_i E[x^2] gamma_i + lambda anchor) /
    (sum_i E[x^2] + lambda), x the calibrated model's MLP output (the layer scale's input)."""
    base, experts, merged, data = tiny_openclip_world(layer_scale=0.5)
    family = OpenCLIPVisionFamily()
    hp = FeatCalHParams(num_calibration_examples=12, batch_size=4, module_regex=r"resblocks\.2\.ls_2$", lambda_=0.05)
    model = copy.deepcopy(merged)
    FeatCalEngine(family, hp, "cpu", progress=False).run(model, base, experts, {t: iter(v) for t, v in data.items()})
    ls = lambda m: family.blocks(m)[2].ls_2  # noqa: E731
    second = torch.zeros(32, dtype=torch.float64)
    rhs = torch.zeros(32, dtype=torch.float64)
    for task, expert in experts.items():
        inputs = []
        handle = ls(merged).register_forward_pre_hook(lambda _m, a: inputs.append(a[0].double()))
        with torch.no_grad():
            for images in data[task]:
                merged(images)  # blocks 0-1 are not selected: the calibrated prefix is the merged one
        handle.remove()
        x = torch.cat([i.reshape(-1, 32) for i in inputs])
        q = (x * x).mean(0)
        second += q
        rhs += q * ls(expert).gamma.double()
    anchor = hp.rho * ls(merged).gamma.double() + (1 - hp.rho) * ls(base).gamma.double()
    expected = (rhs + hp.lambda_ * anchor) / (second + hp.lambda_)
    torch.testing.assert_close(ls(model).gamma.double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ls(model).gamma, ls(merged).gamma)


@pytest.mark.parametrize("model", ["ViT-B-32", "ViT-B-16", "ViT-L-14"])
@pytest.mark.parametrize("name", [f"{m}/openclip_{s}" for m in ("featcal", "surgery", "probsurgery")
                                  for s in ("ta", "simple_average", "wudi")])
def test_the_issue_command_composes_offline_with_our_openclip_pools(name, model, monkeypatch):
    """`fusion_bench method=<featcal|surgery|probsurgery>/openclip_* modelpool=OpenCLIPVisionModelPool/<model>_TA8_quickgelu
    taskpool=OpenCLIPVisionModelTaskPool/<model>_TA8_active_task` composes with no connection (it cannot run here:
    the checkpoints and datasets are downloads). This repository's config/ is put on the search path explicitly."""
    import socket
    from pathlib import Path

    import fusion_bench_config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def no_network(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    repo_config = Path(__file__).resolve().parents[1] / "config"
    search = f"hydra.searchpath=[file://{repo_config}]"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
            cfg = compose("fabric_model_fusion", overrides=[
                search, f"method={name}", f"modelpool=OpenCLIPVisionModelPool/{model}_TA8_quickgelu",
                f"taskpool=OpenCLIPVisionModelTaskPool/{model}_TA8_active_task",
            ])
            clip = compose("fabric_model_fusion", overrides=[search, f"method={name.replace('openclip_', 'clip_')}"])
            theirs = compose("fabric_model_fusion", overrides=[
                search, f"modelpool=OpenCLIPVisionModelPool/{model}_TA8", f"taskpool=OpenCLIPVisionModelTaskPool/{model}_TA8",
            ])
    finally:
        GlobalHydra.instance().clear()
    assert cfg.method == clip.method  # the same method and upstream as the CLIP config it composes from
    upstream = {"ta": "TaskArithmeticAlgorithm", "simple_average": "SimpleAverageAlgorithm", "wudi": "WUDIMerging"}
    assert cfg.method.upstream._target_.endswith(upstream[name.split("openclip_")[1]])
    assert cfg.modelpool._target_ == "featcal_fusionbench.integration.openclip_pools.OpenCLIPPool"
    assert cfg.taskpool._target_ == "featcal_fusionbench.integration.openclip_pools.OpenCLIPTaskPool"
    ours, fb = (OmegaConf.to_container(c.modelpool, resolve=True) for c in (cfg, theirs))
    # FusionBench's pool with every checkpoint rebuilt under its architecture's name (B-16 / L-14 name the pickles
    # alone in FusionBench's configs: their modules would run under open_clip 3.x's code)
    path = lambda e: e["pickle_path"] if isinstance(e, dict) else e  # noqa: E731
    assert {k: path(v) for k, v in ours["models"].items()} == {k: path(v) for k, v in fb["models"].items()}
    assert all(v["model_name"] == model for v in ours["models"].values())
    assert {k: v for k, v in ours.items() if k not in ("_target_", "models")} == {
        k: v for k, v in fb.items() if k not in ("_target_", "models")}
    assert {k: v for k, v in cfg.taskpool.items() if k != "_target_"} == {
        k: v for k, v in theirs.taskpool.items() if k != "_target_"}
