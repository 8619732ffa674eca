"""An offline CLIP world served through FusionBench's OpenCLIP pool and task pool.

The worlds are built as HF CLIP checkpoints. Here each pool entry is converted, when the pool loads it, into what
FusionBench's ``OpenCLIPVisionModelPool`` serves for the task-vector checkpoints: an ``ImageEncoder`` around an
open_clip ``VisionTransformer`` (``openclip_convert.hf_to_openclip``: the same weights under open_clip's names, the
fused q/k/v, the world's ``visual_projection`` as ``proj``), with open_clip's image transforms at the world's size and
normalisation. The zero-shot heads are FusionBench's ``ClassificationHead`` (normalising) over the same text
embeddings that the HF task pool computes, so that both pools score one network and agree up to float rounding.

Configs: ``modelpool=OpenCLIPVisionModelPool/offline_clip8 taskpool=OpenCLIPVisionModelTaskPool/offline_clip8``
(``offline_clip_quick`` likewise); ``featcal-world args clip --openclip`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import List, Optional, Sequence, Union

import torch
from fusion_bench.models.open_clip import ImageEncoder
from omegaconf import DictConfig
from open_clip.transform import image_transform
from torch import Tensor, nn

from featcal_fusionbench.models.openclip_convert import hf_to_openclip
from .clip_common import zero_shot_head


class ConvertedImageEncoder(ImageEncoder):
    """FusionBench's ``ImageEncoder`` whose ``model`` is the open_clip vision tower itself (the world's text tower is
    HF's and only makes the heads), with open_clip's evaluation and training transforms."""

    def __init__(self, tower: nn.Module, image_size: int, mean: Sequence[float], std: Sequence[float]):
        nn.Module.__init__(self)  # not ImageEncoder.__init__: it builds a named open_clip model from the hub
        self.model = tower
        self.train_preprocess = image_transform(image_size, is_train=True, mean=tuple(mean), std=tuple(std))
        self.val_preprocess = image_transform(image_size, is_train=False, mean=tuple(mean), std=tuple(std))

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)  # what ImageEncoder's `model.encode_image` returns: the projected feature


@lru_cache(maxsize=4)
def _clip_parts(clip: str):
    """The world's pretrained CLIP (text tower and projection) and its processor, read once per process."""
    from transformers import CLIPModel, CLIPProcessor

    return CLIPModel.from_pretrained(clip).eval(), CLIPProcessor.from_pretrained(clip)


def converted_encoder(checkpoint: str, clip: str) -> ConvertedImageEncoder:
    """The HF ``CLIPVisionModel`` at ``checkpoint`` as an OpenCLIP ``ImageEncoder``; ``clip`` is the world's pretrained
    ``CLIPModel`` folder, whose ``visual_projection`` every expert shares and whose processor gives the transforms."""
    from transformers import CLIPVisionModel

    model, processor = _clip_parts(clip)
    tower = hf_to_openclip(CLIPVisionModel.from_pretrained(checkpoint), model.visual_projection.weight.detach())
    images = processor.image_processor
    size = images.crop_size["height"]
    if images.crop_size["width"] != size or images.size.get("shortest_edge", size) != size:
        raise ValueError(f"{clip}: the OpenCLIP transforms need a square crop equal to the resize; the processor has "
                         f"size {images.size} and crop {images.crop_size}")
    return ConvertedImageEncoder(tower, size, images.image_mean, images.image_std)


def zero_shot_classification_head(
    clip: str,
    classnames: Union[Mapping, List[str]],
    templates: Union[Mapping, List[str]],
    task: Optional[str] = None,
):
    """FusionBench's ``ClassificationHead`` (normalising) with the world's zero-shot weights for ``task``
    (``classnames`` / ``templates``: a task's lists, or world.json's mappings of every task and ``task`` its key)."""
    from fusion_bench.models.open_clip import ClassificationHead

    def pick(entry, what):
        if isinstance(entry, (Mapping, DictConfig)):
            if task is None or task not in entry:
                raise KeyError(f"no {what} for task {task!r}; known: {sorted(entry)}")
            return list(entry[task])
        return list(entry)

    model, processor = _clip_parts(clip)
    weights = zero_shot_head(model, processor.tokenizer, pick(classnames, "class names"), pick(templates, "templates"))
    return ClassificationHead(normalize=True, weights=weights.to(torch.float32))
