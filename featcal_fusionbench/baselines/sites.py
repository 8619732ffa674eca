"""Where Surgery's and ProbSurgery's per-task maps sit, one site per model family.

A site knows how to batch a task's calibration examples, which feature of a model the maps act on
(rows of a matrix: one per image, or one per target token), and how the trained wrapper is deployed.

- CLIP vision: the projected, L2-normalised image feature, where FusionBench's classifier applies
  ``compute_surgery_features`` before the zero-shot head.
- T5 (encoder-decoder): the decoder's final hidden state entering ``lm_head``, per target token under
  teacher forcing. That is the representation the output head reads, as CLIP's image feature is; an
  encoder-side map would reach the output only through the decoder's cross-attention. At generation
  the map is applied to every decoded position through a pre-hook on ``lm_head``, with the task chosen
  by the task pool (``active_task``).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import T5ForConditionalGeneration, default_data_collator

from ..architectures.t5 import IGNORE_INDEX, teacher_forcing_columns, trim_padding


def _loader(dataset, batch_size: int, shuffle: bool, seed: int, collate_fn=None) -> Iterator[Any]:
    """Endless seeded shuffled batches, or (``shuffle=False``) one ordered pass."""
    if not shuffle:
        return iter(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn))
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=generator,
        drop_last=len(dataset) >= batch_size, collate_fn=collate_fn,
    )
    return (batch for _ in itertools.count() for batch in loader)


class CLIPImageFeatureSite:
    """The projected, normalised image embedding (FusionBench's CLIP protocol)."""

    def __init__(self, modelpool):
        clip = modelpool.load_clip_model("_pretrained_")
        self.projection = copy.deepcopy(clip.visual_projection).requires_grad_(False)
        self.processor = modelpool.load_processor()
        self.dim = self.projection.out_features

    def to(self, device) -> "CLIPImageFeatureSite":
        self.projection.to(device)
        return self

    def batches(self, dataset, batch_size: int, shuffle: bool, seed: int) -> Iterator[Tensor]:
        from fusion_bench.dataset.image_dataset import ImageClassificationDataset

        images = _loader(ImageClassificationDataset(dataset, self.processor), batch_size, shuffle, seed)
        return (x for x, _ in images)

    def features(self, model: nn.Module, images: Tensor) -> Tensor:
        embeds = self.projection(model(images)[1])
        return embeds / embeds.norm(p=2, dim=-1, keepdim=True)

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        return wrapper  # FusionBench's CLIP task pool applies it by duck typing


class LMHeadSurgery(nn.Module):
    """A seq2seq model whose ``lm_head`` input passes through the active task's map.

    ``active_task`` is set by the task pool (``featcal_fusionbench.text_taskpool.active_task``); with no
    active task the merged model runs unchanged.
    """

    is_surgery_model = True

    def __init__(self, maps: nn.Module):
        super().__init__()
        self.maps = maps  # Surgery or ProbSurgery wrapper around the merged model
        self.active_task: Optional[str] = None
        self.model.lm_head.register_forward_pre_hook(self._map_features)

    @property
    def model(self) -> nn.Module:
        return self.maps.model

    def _map_features(self, _module, args):
        if self.active_task is None:
            return None
        (hidden,) = args
        mapped = self.maps.compute_surgery_features(hidden, self.active_task)[0]
        return (mapped.to(hidden.dtype),)

    def collect_trainable_params(self):
        return self.maps.collect_trainable_params()

    def generate(self, *args, **kwargs):
        return self.model.generate(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class T5DecoderFeatureSite:
    """The decoder's final hidden state at every target token (teacher forcing on the labels)."""

    def __init__(self, model: T5ForConditionalGeneration):
        self.dim = model.config.d_model

    def to(self, device) -> "T5DecoderFeatureSite":
        return self

    def batches(self, dataset, batch_size: int, shuffle: bool, seed: int) -> Iterator[dict]:
        batches = _loader(teacher_forcing_columns(dataset), batch_size, shuffle, seed, default_data_collator)
        return (trim_padding(b) for b in batches)

    def features(self, model: nn.Module, batch: dict) -> Tensor:
        captured = []
        handle = model.lm_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            # Teacher forcing without the loss: the decoder reads the shifted labels, as the expert did in training.
            model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                decoder_input_ids=model._shift_right(batch["labels"]),
            )
        finally:
            handle.remove()
        return captured[-1][batch["labels"] != IGNORE_INDEX]

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        return LMHeadSurgery(wrapper)


def feature_site(modelpool, base: nn.Module):
    if isinstance(base, T5ForConditionalGeneration):
        return T5DecoderFeatureSite(base)
    if hasattr(modelpool, "load_clip_model"):
        return CLIPImageFeatureSite(modelpool)
    raise TypeError(
        f"Surgery and ProbSurgery have no feature site for {type(base).__name__} in a {type(modelpool).__name__}; "
        "known: CLIP vision models in a CLIPVisionModelPool, T5ForConditionalGeneration"
    )
