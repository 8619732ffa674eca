"""A toy CLIP world: seconds to build, for tests and a smoke run of the whole pipeline.

Tiny random CLIP (vision and text towers, the real CLIP BPE tokenizer), a few
synthetic image tasks (per-class prototype images plus noise, so each task is
learnable and the tasks differ), and per-task experts: the vision tower fine-tuned
against frozen zero-shot heads from the base text tower, as FusionBench's experts
are. Its accuracies say nothing about the paper's regime; the offline CLIP world
built from real packaged data is for that.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from featcal_fusionbench.models.openclip_convert import clip_tokenizer

from .clip_common import finetune_vision_tower, write_fusion_bench_configs, zero_shot_head

CLASS_WORDS = ["circle", "square", "triangle", "star", "cross", "ring", "wave", "dot"]
TEMPLATES = ["a photo of a {}.", "a picture of a {}."]


@dataclass
class ToyCLIPSpec:
    num_tasks: int = 2
    num_classes: int = 4
    image_size: int = 16
    patch_size: int = 8
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    projection_dim: int = 16
    train_per_class: int = 16
    test_per_class: int = 8
    noise: float = 0.35
    finetune_steps: int = 40
    finetune_lr: float = 3e-3
    seed: int = 0
    name: str = "toy"

    def task_names(self) -> List[str]:
        return [f"{self.name}_{i}" for i in range(self.num_tasks)]


def _clip_config(spec: ToyCLIPSpec):
    from transformers import CLIPConfig

    vision = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.projection_dim,
    )
    text = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=spec.num_heads,
        max_position_embeddings=32,
        projection_dim=spec.projection_dim,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=spec.projection_dim)


def _images(prototype: np.ndarray, count: int, noise: float, rng: np.random.Generator) -> List[Image.Image]:
    out = []
    for _ in range(count):
        pixels = np.clip(prototype + noise * rng.standard_normal(prototype.shape), 0.0, 1.0)
        out.append(Image.fromarray((pixels * 255).astype(np.uint8)))
    return out


def build_toy_clip_world(root: Path, spec: ToyCLIPSpec = ToyCLIPSpec()) -> Dict[str, str]:
    """Build the world under ``root``; return the paths of its pool and task-pool YAMLs."""
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature
    from datasets.utils.logging import disable_progress_bar
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPVisionModel

    root = Path(root).resolve()
    disable_progress_bar()  # one bar per saved shard drowns the build's own progress
    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)

    pretrained_dir = root / "pretrained"
    tokenizer = clip_tokenizer(root / "tokenizer")
    size = spec.image_size
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    clip_model = CLIPModel(_clip_config(spec)).eval()
    clip_model.save_pretrained(pretrained_dir)
    processor.save_pretrained(pretrained_dir)

    classnames: Dict[str, List[str]] = {}
    data_paths: Dict[str, Dict[str, str]] = {}
    for t, task in enumerate(spec.task_names()):
        names = [f"{CLASS_WORDS[c % len(CLASS_WORDS)]} {t}" for c in range(spec.num_classes)]
        classnames[task] = names
        features = Features({"image": ImageFeature(), "label": ClassLabel(names=names)})
        prototypes = rng.random((spec.num_classes, size, size, 3))
        data_paths[task] = {}
        for split, per_class in (("train", spec.train_per_class), ("test", spec.test_per_class)):
            images, labels = [], []
            for c in range(spec.num_classes):
                images += _images(prototypes[c], per_class, spec.noise, rng)
                labels += [c] * per_class
            path = root / "data" / task / split
            Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(str(path))
            data_paths[task][split] = str(path)

    from datasets import load_from_disk

    expert_dirs = {}
    for t, task in enumerate(tqdm(spec.task_names(), desc="fine-tuning toy experts")):
        head = zero_shot_head(clip_model, tokenizer, classnames[task], TEMPLATES)
        expert = CLIPVisionModel.from_pretrained(pretrained_dir)
        train = load_from_disk(data_paths[task]["train"])
        pixels = processor(images=list(train["image"]), return_tensors="pt")["pixel_values"]
        generator = torch.Generator().manual_seed(spec.seed + 1 + t)
        finetune_vision_tower(
            clip_model, expert.vision_model, head, pixels, torch.tensor(train["label"]),
            spec.finetune_steps, 16, spec.finetune_lr, generator,
        )
        expert_dirs[task] = str(root / "experts" / task)
        expert.save_pretrained(expert_dirs[task])

    paths = write_fusion_bench_configs(
        root, spec.name, pretrained_dir, expert_dirs, data_paths, classnames, TEMPLATES, eval_batch_size=64
    )
    (root / "world.json").write_text(json.dumps({"spec": asdict(spec), "classnames": classnames}, indent=2))
    return paths
