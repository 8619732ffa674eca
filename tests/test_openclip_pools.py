"""featcal_fusionbench.integration.openclip_pools: FusionBench's OpenCLIP pools importable on Python < 3.12, the encoders built with
the activation their weights were trained with, and Surgery / ProbSurgery applied per task by the task pool.

The pools run on a tiny open_clip architecture registered for the module (``featcal-tiny``, OpenAI-style: its config
builds nn.GELU, its ``openai`` weights are listed as trained with QuickGELU, as ViT-B-32's are). Its pretrained entry has
no URL: any download attempt fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset
from omegaconf import OmegaConf
from PIL import Image

import featcal_fusionbench.integration.openclip_pools as pools
from featcal_fusionbench import FeatCalAlgorithm, ProbSurgeryAlgorithm, SurgeryAlgorithm
from featcal_fusionbench.baselines import SurgeryModelWrapper
from featcal_fusionbench.models.task_switch import EncoderOutputSurgery
from featcal_fusionbench.families import family_for
from featcal_fusionbench.families.openclip_vision import OpenCLIPVisionFamily, activation_of
from featcal_fusionbench.integration.upstream import load_torch_file
from fusion_bench.method import TaskArithmeticAlgorithm
from fusion_bench.models.open_clip import ClassificationHead, ImageClassifier
from fusion_bench.taskpool import OpenCLIPVisionModelTaskPool
from fusion_bench.utils import instantiate

from helpers import perturbed, tiny_clip_vision

TINY = "featcal-tiny"
TASKS = ["sun-397", "cars"]  # a dash: the maps are keyed by FusionBench's regularize_name
TA = {"_target_": "fusion_bench.method.TaskArithmeticAlgorithm", "scaling_factor": 0.3, "inplace": False}


@pytest.fixture(scope="module")
def tiny_architecture():
    import open_clip.factory
    import open_clip.pretrained

    config = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8, "head_width": 8, "mlp_ratio": 2.0},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(open_clip.factory._MODEL_CONFIGS, TINY, config)
        patch.setitem(open_clip.pretrained._PRETRAINED, TINY, {"openai": open_clip.pretrained._pcfg(quick_gelu=True)})
        yield TINY


def pictures(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(16, 16, 3, generator=g) * 255).byte().numpy()) for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_pool(tiny_architecture, tmp_path_factory):
    """On disk as the task-vector checkpoints are: the base a pickled encoder, the experts state dicts, pickled
    heads that normalise; HF datasets of images; YAMLs for our model pool and task pool."""
    root = tmp_path_factory.mktemp("tiny_openclip")
    torch.manual_seed(0)
    base = pools.CheckpointImageEncoder(TINY)
    with torch.no_grad():  # open_clip starts norms at (1, 0): spread them
        for name, p in base.named_parameters():
            if ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    torch.save(base, root / "zeroshot.pt")
    models = {"_pretrained_": {"model_name": TINY, "pickle_path": str(root / "zeroshot.pt")}}
    heads, datasets = {}, {"train": {}, "test": {}}
    for i, task in enumerate(TASKS):
        torch.save(perturbed(base, 0.05, 10 + i).state_dict(), root / f"{task}.pt")
        models[task] = {"model_name": TINY, "state_dict_path": str(root / f"{task}.pt")}
        head = ClassificationHead(normalize=True, weights=torch.randn(3, 16, generator=torch.Generator().manual_seed(i)))
        torch.save(head, root / f"head_{task}.pt")
        heads[task] = str(root / f"head_{task}.pt")
        for split, count in (("train", 12), ("test", 10)):
            path = root / "data" / task / split
            Dataset.from_dict({"image": pictures(count, 100 * i + count), "label": [k % 3 for k in range(count)]}).save_to_disk(str(path))
            datasets[split][task] = {"_target_": "datasets.load_from_disk", "dataset_path": str(path)}
    pool = {"_target_": "featcal_fusionbench.integration.openclip_pools.OpenCLIPPool", "_recursive_": False, "models": models,
            "classification_heads": heads, "train_datasets": datasets["train"], "test_datasets": datasets["test"]}
    taskpool = {"_target_": "featcal_fusionbench.integration.openclip_pools.OpenCLIPTaskPool", "_recursive_": False,
                "test_datasets": datasets["test"], "classification_heads": heads, "model_name": TINY,
                "dataloader_kwargs": {"batch_size": 4, "num_workers": 0, "shuffle": False}}
    for name, content in (("modelpool", pool), ("taskpool", taskpool)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump(content))
    return {"root": root, "base": base, "modelpool": str(root / "modelpool.yaml"), "taskpool": str(root / "taskpool.yaml")}


def load(path):
    return instantiate(OmegaConf.load(path))


def taskpool_for(tiny_pool, modelpool, fabric, cls=None):
    """The task pool as FusionBench's program sets it up (it reads the data transform from the program's pool)."""
    config = OmegaConf.load(tiny_pool["taskpool"])
    if cls is not None:
        config._target_ = f"{cls.__module__}.{cls.__qualname__}"
    taskpool = instantiate(config)
    taskpool._program = SimpleNamespace(modelpool=modelpool)
    taskpool._fabric_instance = fabric
    return taskpool


def scores(report):
    return {t: v for t, v in report.items() if t in TASKS}


@pytest.mark.slow
def test_fusion_benchs_openclip_pools_import_on_this_python_through_the_backport():
    """In a fresh interpreter: FusionBench's own module fails on Python < 3.12 (`from typing import override`), and
    imports once this package's pool module is imported."""
    script = textwrap.dedent("""
        import sys, typing
        try:
            import fusion_bench.modelpool.openclip_vision.modelpool
            failed = None
        except ImportError as error:
            failed = str(error)
        assert (failed is not None) == (sys.version_info < (3, 12)), failed
        assert failed is None or "override" in failed, failed
        import featcal_fusionbench.integration.openclip_pools
        from fusion_bench.modelpool import OpenCLIPVisionModelPool
        from fusion_bench.taskpool import OpenCLIPVisionModelTaskPool
        if sys.version_info < (3, 12):
            import typing_extensions
            assert typing.override is typing_extensions.override
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_build_arguments_give_the_activation_and_transforms_of_the_named_weights():
    import open_clip

    name, openai = pools.build_arguments("ViT-B-32")  # FusionBench's name for the OpenAI weights
    assert name == "ViT-B-32" and openai["force_quick_gelu"] is True
    assert openai["image_mean"] == open_clip.OPENAI_DATASET_MEAN and openai["image_interpolation"] == "bicubic"
    assert pools.build_arguments("ViT-L-14")[1]["force_quick_gelu"] is True
    assert pools.build_arguments("ViT-B-32__pretrained__laion2b_s34b_b79k")[1]["force_quick_gelu"] is False
    assert pools.build_arguments("ViT-B-16__init__") == ("ViT-B-16", {})  # random weights: open_clip's defaults
    with pytest.raises(ValueError, match="'ViT-X'.*has no model"):
        pools.build_arguments("ViT-X")
    with pytest.raises(ValueError, match="no pretrained tag 'nope'.*activation.*unknown.*laion2b_s34b_b79k"):
        pools.build_arguments("ViT-B-32__pretrained__nope")


def test_the_pool_builds_quickgelu_encoders_and_loads_the_pickled_and_state_dict_checkpoints(tiny_pool):
    """The architecture's config builds nn.GELU, as open_clip 3.x's ViT-B-32 does; the pool builds the QuickGELU its
    weights were trained with, loads them (the encoder computes what the saved one does) and passes the family's
    activation check for that reason."""
    import open_clip
    from open_clip.transformer import QuickGELU

    assert activation_of(open_clip.create_model(TINY).visual) is torch.nn.GELU
    pool = load(tiny_pool["modelpool"])
    assert isinstance(pool, pools.OpenCLIPPool)
    base = pool.load_pretrained_model()
    expert = pool.load_model(TASKS[0])
    for model in (base, expert):
        assert isinstance(model, pools.CheckpointImageEncoder) and activation_of(model.model.visual) is QuickGELU
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(base(images), tiny_pool["base"](images), rtol=0, atol=0)
    saved = torch.load(tiny_pool["root"] / f"{TASKS[0]}.pt", weights_only=True)
    assert all(torch.equal(v, saved[k]) for k, v in expert.state_dict().items())
    # built without initializing the weights the checkpoint overwrites: the one buffer it does not hold is built
    assert torch.equal(expert.model.attn_mask, tiny_pool["base"].model.attn_mask)
    # the read tensors are taken, not copied, but as the built encoder's dtype: a half-precision checkpoint loads
    # as the float32 encoder it is loaded into
    half = tiny_pool["root"] / "half.pt"
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in saved.items()}, half)
    loaded = pool.load_model({"model_name": TINY, "state_dict_path": str(half)})
    assert all(v.dtype == saved[k].dtype for k, v in loaded.state_dict().items())
    assert all(torch.equal(v, saved[k].half().to(v.dtype)) for k, v in loaded.state_dict().items() if v.is_floating_point())
    OpenCLIPVisionFamily().check_models(pool, base)  # no mismatch
    # the data transform is the built encoder's evaluation transform (OpenAI's normalisation)
    assert pool.test_processor is base.val_preprocess
    assert list(pool.test_processor.transforms[-1].mean) == list(open_clip.OPENAI_DATASET_MEAN)


def test_a_zip_checkpoint_is_mapped_from_its_file_and_a_legacy_one_read(tmp_path):
    """torch.save's zip format is mapped (the file is in this process's mappings while its tensors live) and the
    legacy format read whole; both load what was saved, and writing to a loaded tensor leaves the file as it was."""
    saved = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    zipped, legacy = tmp_path / "zip.pt", tmp_path / "legacy.pt"
    torch.save(saved, zipped)
    torch.save(saved, legacy, _use_new_zipfile_serialization=False)

    def mapped(path) -> bool:
        with open("/proc/self/maps") as maps:
            return str(path) in maps.read()

    from_zip, from_legacy = load_torch_file(str(zipped), True), load_torch_file(str(legacy), True)
    assert mapped(zipped) and not mapped(legacy)
    assert torch.equal(from_zip["w"], saved["w"]) and torch.equal(from_legacy["w"], saved["w"])
    from_zip["w"].add_(1.0)
    assert torch.equal(torch.load(zipped, weights_only=True)["w"], saved["w"])


def test_a_bad_model_name_fails_before_the_checkpoint_is_read(tiny_architecture):
    pool = pools.OpenCLIPPool(OmegaConf.create({"_pretrained_": {"model_name": "ViT-X", "pickle_path": "/absent.pt"}}))
    with pytest.raises(ValueError, match="'ViT-X'"):
        pool.load_pretrained_model()


@pytest.mark.parametrize("cls", [FeatCalAlgorithm, SurgeryAlgorithm], ids=lambda c: c.__name__)
def test_a_merged_encoder_saved_by_the_pool_is_read_back_by_merged_model_path(cls, tiny_pool, tmp_path):
    """`merged_model_save_path` on an OpenCLIP pool writes the state dict file of BaseModelPool.save_model (an
    ImageEncoder has no save_pretrained); a calibrator's `method.merged_model_path` reads that file back into the base's
    class and calibrates what it would calibrate from the upstream merger itself."""
    pool = load(tiny_pool["modelpool"])
    pool.save_model(TaskArithmeticAlgorithm(scaling_factor=0.3, inplace=False).run(pool), str(tmp_path / "merged"))
    assert (tmp_path / "merged").is_file()
    results = []
    for kwargs in ({"upstream": TA}, {"upstream": None, "merged_model_path": str(tmp_path / "merged")}):
        algo = cls(num_calibration_examples=8, batch_size=4, **({"max_steps": 2} if cls is SurgeryAlgorithm else {}),
                   **kwargs)
        algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
        results.append(algo.run(load(tiny_pool["modelpool"])).state_dict())
    assert list(results[0]) == list(results[1])
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, msg=key)
    with pytest.raises(FileNotFoundError, match="merged_model_path=.*absent.*: no such file or folder"):
        cls(upstream=None, merged_model_path=str(tmp_path / "absent"), num_calibration_examples=8)  # at once
    (tmp_path / "a_folder").mkdir()
    algo = cls(upstream=None, merged_model_path=str(tmp_path / "a_folder"), num_calibration_examples=8)
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(FileNotFoundError, match="state dict file"):
        algo.run(load(tiny_pool["modelpool"]))


def run_baseline(cls, tiny_pool, **kwargs):
    kwargs.setdefault("batch_size", 4)
    algo = cls(upstream=TA, num_calibration_examples=8, **kwargs)
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    return algo, algo.run(load(tiny_pool["modelpool"]))


def test_replayed_features_train_the_maps_that_streamed_ones_train(tiny_pool):
    """precompute_features=replay on the encoders' output (one row per image): 8 images in batches of 3 (two a
    step, the last two dropped, reshuffled each epoch) over 5 steps, the same maps as streamed, to float rounding."""
    def maps(mode):
        _, model = run_baseline(ProbSurgeryAlgorithm, tiny_pool, max_steps=5, batch_size=3, precompute_features=mode)
        return {k: v for k, v in model.state_dict().items() if ".heads." in f".{k}" or k.startswith("heads.")}

    streamed, replayed = maps(False), maps("replay")
    assert streamed and streamed.keys() == replayed.keys()
    for key, value in streamed.items():
        torch.testing.assert_close(replayed[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("cls", [SurgeryAlgorithm, ProbSurgeryAlgorithm], ids=lambda c: c.__name__)
def test_untrained_maps_score_exactly_like_the_upstream_model(cls, tiny_pool):
    algo, out = run_baseline(cls, tiny_pool, max_steps=0, return_upstream=True)
    key = cls.method_name.lower()
    assert isinstance(out[key], EncoderOutputSurgery) and out[key].is_surgery_model
    taskpool = taskpool_for(tiny_pool, load(tiny_pool["modelpool"]), algo.fabric)
    assert scores(taskpool.evaluate(out[key])) == scores(taskpool.evaluate(out["upstream"]))


def test_the_feature_site_is_the_encoders_output_and_deploys_on_it(tiny_pool):
    """Surgery's original site on the task-vector encoders: ImageEncoder.forward's output, not normalised."""
    encoder = tiny_pool["base"]
    site = OpenCLIPVisionFamily().feature_site(None, encoder)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(site.features(encoder, images), encoder(images))
    assert site.dim == 16
    deployed = site.deploy(SurgeryModelWrapper(encoder, TASKS, projection_dim=16))
    assert isinstance(deployed, EncoderOutputSurgery) and deployed.val_preprocess is encoder.val_preprocess


def test_the_task_pool_applies_each_datasets_own_map(tiny_pool):
    """Maps that change the features: our task pool scores each dataset with that task's map, exactly as
    FusionBench's own task pool scores a model pinned to that task; FusionBench's task pool alone (no task set)
    scores the upstream model."""
    algo, deployed = run_baseline(SurgeryAlgorithm, tiny_pool, max_steps=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in deployed.maps.named_parameters():
            if "feature_mapping" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    ours = scores(taskpool_for(tiny_pool, load(tiny_pool["modelpool"]), algo.fabric).evaluate(deployed))
    fusion_bench = taskpool_for(tiny_pool, load(tiny_pool["modelpool"]), algo.fabric, OpenCLIPVisionModelTaskPool)
    unmapped = scores(fusion_bench.evaluate(deployed))
    assert deployed.active_task is None  # restored after the evaluation
    for task in TASKS:
        deployed.active_task = task
        assert ours[task] == scores(fusion_bench.evaluate(deployed))[task]
        assert ours[task]["loss"] != unmapped[task]["loss"]
    deployed.active_task = None


# ---- one network through HF CLIP and OpenCLIP ---------------------------------------------------------------


def test_one_network_and_one_map_classify_alike_through_hf_clip_and_openclip():
    """HF CLIP's protocol maps the normalised projected feature and takes its dot product with the zero-shot text
    embeddings; OpenCLIP's maps the raw encoder output and its head normalises. Surgery's and ProbSurgery's maps are
    bias-free with ReLU, so M(c f) = c M(f) for c > 0: with the same map, OpenCLIP's logits are HF's divided by
    |M(f / |f|)|, per image, and both predict the same classes. (Trained maps differ: each fits its own features.)"""
    from fusion_bench.models.hf_clip import HFCLIPClassifier
    from transformers import CLIPConfig, CLIPModel

    from featcal_fusionbench.models.openclip_convert import hf_to_openclip
    from helpers import tiny_image_encoder

    hf = tiny_clip_vision(seed=3)
    clip = CLIPModel(CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 8},
        vision_config=hf.config.to_dict(), projection_dim=16,
    )).eval()
    projection = clip.visual_projection.weight.detach()
    encoder = tiny_image_encoder()
    encoder.model.visual = hf_to_openclip(hf, projection)
    assert family_for(encoder).name == "openclip_vision"

    torch.manual_seed(0)
    hf_maps = SurgeryModelWrapper(hf, TASKS, projection_dim=16, hidden_dim=4)
    torch.manual_seed(0)
    oc_maps = SurgeryModelWrapper(encoder, TASKS, projection_dim=16, hidden_dim=4)
    with torch.no_grad():  # the same trained-looking map for both
        g = torch.Generator().manual_seed(1)
        for p, q in zip(hf_maps.collect_trainable_params(), oc_maps.collect_trainable_params(), strict=True):
            q.copy_(p.copy_(torch.randn(p.shape, generator=g)))
    images = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    text = F.normalize(torch.randn(5, 16, generator=torch.Generator().manual_seed(4)), dim=-1)
    scale = clip.logit_scale.exp()

    site = OpenCLIPVisionFamily().feature_site(None, encoder)
    raw = site.features(encoder, images)
    with torch.no_grad():
        torch.testing.assert_close(F.normalize(raw, dim=-1),
                                   F.normalize(hf(pixel_values=images).pooler_output @ projection.t(), dim=-1),
                                   rtol=1e-5, atol=1e-5)
        clip.vision_model = hf_maps
        hf_classifier = HFCLIPClassifier(clip, processor=None)
        hf_classifier.zeroshot_weights = text
        hf_logits = hf_classifier(images, task_name=TASKS[1])

        deployed = EncoderOutputSurgery(oc_maps).eval()
        deployed.active_task = TASKS[1]
        head = ClassificationHead(normalize=True, weights=scale * text)
        oc_logits = ImageClassifier(deployed, head)(images)
        mapped_unit = hf_maps.compute_surgery_features(F.normalize(raw, dim=-1), TASKS[1])[0]

    torch.testing.assert_close(oc_logits * mapped_unit.norm(dim=-1, keepdim=True), hf_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(oc_logits.argmax(-1), hf_logits.argmax(-1))
    assert not torch.allclose(oc_logits, hf_logits, rtol=1e-2, atol=1e-2)  # the scales do differ


def test_the_alpha_stage_by_the_feature_site_runs_on_an_openclip_pool(tiny_pool, tmp_path):
    """auto_select alpha_criterion site on the task-vector encoders: each alpha at or above the method's is
    calibrated on the fit parts and scored at the encoders' output (their feature site), and the per-block pass
    runs with the chosen alpha."""
    import json

    algo = FeatCalAlgorithm(upstream=TA, num_calibration_examples=8, batch_size=4, auto_select={
        "alpha_criterion": "site", "widen": False, "noise_z": 0.0,
        "grid": {"lambda_": [1e-3], "rho": [2.0], "alpha": [0.15, 0.6]}})
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1,
                                     loggers=[L.fabric.loggers.CSVLogger(str(tmp_path))])
    algo.run(load(tiny_pool["modelpool"]))
    auto = json.loads(next(tmp_path.rglob("featcal_report.json")).read_text())["auto_select"]
    stage = auto["alpha"]
    assert stage["criterion"] == "site" and set(stage["scores"]) == {"0.3", "0.6"}
    assert stage["folds"] == 4 and stage["calibrations"] == 8  # 8 examples per task: each quarter held out in turn
    assert all(0.0 < value <= 1.0 + 1e-6 for value in stage["scores"].values())
    assert {key.split(",")[2] for key in auto["choice"]["per_block"]} == {f"alpha={stage['chosen']:g}"}


def test_criterion_site_runs_on_an_openclip_pool(tiny_pool, tmp_path):
    """auto_select criterion site on the task-vector encoders: every (lambda, alpha) point calibrated on the fit
    part, scored at the encoders' output, and the best calibrated on every example."""
    import json

    algo = FeatCalAlgorithm(upstream=TA, num_calibration_examples=8, batch_size=4, auto_select={
        "criterion": "site", "search": "grid", "few_examples": "site",  # 8 per task: the criterion itself
        "grid": {"lambda_": [1e-3, 1.0], "alpha": [0.3, 0.6]}})
    algo._fabric_instance = L.Fabric(accelerator="cpu", devices=1,
                                     loggers=[L.fabric.loggers.CSVLogger(str(tmp_path))])
    algo.run(load(tiny_pool["modelpool"]))
    auto = json.loads(next(tmp_path.rglob("featcal_report.json")).read_text())["auto_select"]
    assert auto["criterion_used"] == "site" and auto["calibrations"] == 4 and auto["split"]
    assert all(0.0 < c["score"] <= 1.0 + 1e-6 for c in auto["candidates"].values())
    from featcal_fusionbench.autoselect.options import candidate_key

    best = max(auto["candidates"], key=lambda k: auto["candidates"][k]["score"])
    assert candidate_key(auto["choice"]["global"]) == best and auto["choice"]["global"]["rho"] == 2.0
