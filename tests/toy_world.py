"""The product tests' toy CLIP world: a tiny CLIP model, two tasks of random-prototype images, experts that are
seeded perturbations of the pretrained vision tower, and the FusionBench pool and task-pool YAMLs over them.

Nothing here is trained: the tests check what the methods do to a pool (shapes, reports, equalities between runs),
not how accurate they are; accuracy is measured on the experiments' worlds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import torch
import yaml

TASKS = ("toy_0", "toy_1")
CLASSES = ("circle", "square", "triangle", "star")
TEMPLATES = ["a photo of a {}.", "a picture of a {}."]
IMAGE_SIZE = 16
TRAIN_PER_CLASS, TEST_PER_CLASS = 16, 8


def tiny_clip_config(vocab_size: int):
    from transformers import CLIPConfig

    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, projection_dim=16)
    vision = dict(common, num_hidden_layers=2, image_size=IMAGE_SIZE, patch_size=8)
    text = dict(common, num_hidden_layers=1, max_position_embeddings=32, vocab_size=vocab_size)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def build_toy_world(root: Path, seed: int = 0) -> Dict[str, str]:
    """Build the world under ``root``; return its root, config folder and the pool and task-pool YAMLs."""
    from datasets import ClassLabel, Dataset, Features, Image as ImageFeature
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPVisionModel

    from featcal_fusionbench.models.openclip_convert import clip_tokenizer

    root = Path(root).resolve()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    pretrained = root / "pretrained"
    tokenizer = clip_tokenizer(root / "tokenizer")
    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop), tokenizer)
    CLIPModel(tiny_clip_config(len(tokenizer))).eval().save_pretrained(pretrained)
    processor.save_pretrained(pretrained)

    classnames, data = {}, {}
    for t, task in enumerate(TASKS):
        classnames[task] = [f"{c} {t}" for c in CLASSES]
        features = Features({"image": ImageFeature(), "label": ClassLabel(names=classnames[task])})
        prototypes = rng.random((len(CLASSES), IMAGE_SIZE, IMAGE_SIZE, 3))
        for split, per_class in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
            images, labels = [], []
            for c, prototype in enumerate(prototypes):
                noisy = np.clip(prototype + 0.35 * rng.standard_normal((per_class, *prototype.shape)), 0.0, 1.0)
                images += [Image.fromarray((x * 255).astype(np.uint8)) for x in noisy]
                labels += [c] * per_class
            path = root / "data" / task / split
            Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(str(path))
            data[task, split] = {"_target_": "datasets.load_from_disk", "dataset_path": str(path)}

    experts = {}
    for t, task in enumerate(TASKS):
        expert = CLIPVisionModel.from_pretrained(pretrained)
        generator = torch.Generator().manual_seed(seed + 10 + t)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        experts[task] = str(root / "experts" / task)
        expert.save_pretrained(experts[task])

    pool = {
        "_target_": "fusion_bench.modelpool.CLIPVisionModelPool",
        "_recursive_": False,
        "processor": str(pretrained),
        "models": {"_pretrained_": str(pretrained), **experts},
        "train_datasets": {t: data[t, "train"] for t in TASKS},
        "test_datasets": {t: data[t, "test"] for t in TASKS},
    }
    taskpool = {
        "_target_": "featcal_fusionbench.evaluation.clip_taskpool.LocalCLIPVisionModelTaskPool",
        "_recursive_": False,
        "test_datasets": {t: data[t, "test"] for t in TASKS},
        "processor": str(pretrained),
        "clip_model": str(pretrained),
        "dataloader_kwargs": {"batch_size": 64, "num_workers": 0, "shuffle": False},
        "classnames": classnames,
        "templates": TEMPLATES,
    }
    config = root / "config"
    paths = {
        "modelpool": config / "modelpool" / "CLIPVisionModelPool" / "toy.yaml",
        "taskpool": config / "taskpool" / "CLIPVisionModelTaskPool" / "toy.yaml",
    }
    for key, content in (("modelpool", pool), ("taskpool", taskpool)):
        paths[key].parent.mkdir(parents=True, exist_ok=True)
        paths[key].write_text(yaml.safe_dump(content, sort_keys=False))
    return {"root": root, "config_dir": str(config), **{k: str(v) for k, v in paths.items()}}
