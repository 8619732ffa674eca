"""HF ``CLIPVisionModel`` (and its bare ``CLIPVisionTransformer``).

Embeddings and ``pre_layrnorm`` enter the first block; ``post_layernorm`` keeps its merged values.
Surgery's and ProbSurgery's maps act on the projected, L2-normalised image feature, where
FusionBench's CLIP classifier applies ``compute_surgery_features`` before the zero-shot head.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Hashable, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn
from transformers import CLIPVisionModel, PretrainedConfig
from transformers.models.clip.modeling_clip import CLIPVisionTransformer

from . import register_family
from .base import UNIFORM, FeatureSite, ImagesOnly, ModelFamily, batch_loader
from .sites import LayerNormSite, LinearSite

CLS_WEIGHTED = "cls-weighted"
# k and v of patch tokens still feed the CLS token's attention in the last block,
# so they keep uniform weights even when the other modules down-weight patches.
_KV_MODULES = ("self_attn.k_proj", "self_attn.v_proj")


def check_full_clip_checkpoint(modelpool) -> None:
    """The projection lives in a full CLIPModel checkpoint only: name the pool entry when ``_pretrained_`` is another
    kind (a vision-only CLIPVisionModel checkpoint would otherwise fail deep inside transformers with size
    mismatches). An entry whose config cannot be read here (a hub name offline) is left to the loader."""
    entry = modelpool.get_model_config("_pretrained_")
    name = entry if isinstance(entry, (str, os.PathLike)) else entry.get("pretrained_model_name_or_path", None)
    if name is None:
        return
    try:
        kind = PretrainedConfig.get_config_dict(str(name))[0].get("model_type")
    except OSError:
        return
    if kind != "clip":
        raise ValueError(
            f"Surgery and ProbSurgery on CLIP train on the projected image embedding, whose projection "
            f"(visual_projection) only a full CLIPModel checkpoint holds; the pool's `models._pretrained_` ({name}) "
            f"is a {kind!r} checkpoint. Point `modelpool.models._pretrained_` at the full CLIP checkpoint of the same "
            f"model (as FusionBench's CLIP pools do, e.g. openai/clip-vit-base-patch32); the experts may stay "
            f"vision-only. FeatCal needs no projection and runs on this pool as it is."
        )


class CLIPImageFeatureSite(FeatureSite):
    """The projected, normalised image embedding (FusionBench's CLIP protocol)."""

    def __init__(self, modelpool):
        if not hasattr(modelpool, "load_clip_model"):
            raise TypeError(
                f"Surgery and ProbSurgery on a CLIP vision model need a CLIPVisionModelPool (for the visual "
                f"projection); got a {type(modelpool).__name__}"
            )
        check_full_clip_checkpoint(modelpool)
        clip = modelpool.load_clip_model("_pretrained_")
        self.projection = copy.deepcopy(clip.visual_projection).requires_grad_(False)
        self.dim = self.projection.out_features

    def to(self, device) -> "CLIPImageFeatureSite":
        self.projection.to(device)
        return self

    def features(self, model: nn.Module, images: Tensor) -> Tensor:
        embeds = self.projection(model(images)[1])
        return embeds / embeds.norm(p=2, dim=-1, keepdim=True)


class LastBlockPatchWeighting:
    """The CLIP families' option: weight of patch tokens in the last block's statistics for every site but k/v
    (``kv_sites``; the CLS token keeps weight 1). 1.0 is the paper's uniform weighting; the authors' demo uses 0.01,
    because only the CLS output of the last block reaches the pooled feature."""

    options = {"last_block_patch_token_weight": 1.0}
    kv_sites: Tuple[str, ...] = _KV_MODULES

    def check_option(self, name, value):
        return ModelFamily.non_negative_number(name, value)

    @property
    def last_block_patch_token_weight(self) -> float:
        return float(self.option_values["last_block_patch_token_weight"])

    def weight_profile(self, block_index: int, num_blocks: int, site_name: str) -> Hashable:
        if (
            block_index == num_blocks - 1
            and self.last_block_patch_token_weight != 1.0
            and site_name not in self.kv_sites
        ):
            return CLS_WEIGHTED
        return UNIFORM

    def token_axis(self, meta) -> int:
        """The axis of hidden states that counts tokens (the CLS token is its first)."""
        return 1

    def token_weights(self, profile, hidden, meta, dtype) -> Optional[Tensor]:
        if profile == UNIFORM:
            return None
        # In the moments' dtype: a float32 0.01 is 0.0099999998 to float64 moments.
        weights = torch.full(hidden.shape[:-1], self.last_block_patch_token_weight, dtype=dtype, device=hidden.device)
        weights.select(self.token_axis(meta), 0).fill_(1.0)
        return weights


@register_family
class CLIPVisionFamily(LastBlockPatchWeighting, ModelFamily):
    """Options: ``last_block_patch_token_weight`` (``LastBlockPatchWeighting``)."""

    name = "clip_vision"
    #: (the pool, its processor) that ``_processor`` read last
    _processor_of: tuple = (None, None)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return isinstance(model, (CLIPVisionModel, CLIPVisionTransformer))

    @staticmethod
    def _tower(model: nn.Module) -> CLIPVisionTransformer:
        return model.vision_model if isinstance(model, CLIPVisionModel) else model

    def blocks(self, model):
        return list(self._tower(model).encoder.layers)

    def stem_modules(self, model):
        tower = self._tower(model)
        return [tower.embeddings, tower.pre_layrnorm]

    def embed(self, model, inputs) -> Tuple[Tensor, Any]:
        tower = self._tower(model)
        dtype = tower.embeddings.patch_embedding.weight.dtype
        return tower.pre_layrnorm(tower.embeddings(inputs.to(dtype))), None

    def run_block(self, block, hidden, meta):
        return block(hidden, None, None)[0]

    def sites(self, block):
        found = {}
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                found[name] = LinearSite(module)
            elif isinstance(module, nn.LayerNorm):
                found[name] = LayerNormSite(module)
        return found

    def batches(self, modelpool, dataset, batch_size, shuffle=False, seed=0) -> Iterator[Tensor]:
        from fusion_bench.dataset.image_dataset import ImageClassificationDataset

        images = batch_loader(ImageClassificationDataset(ImagesOnly(dataset), self._processor(modelpool)), batch_size,
                              shuffle, seed)
        return (pixel_values for pixel_values, _labels in images)

    def _processor(self, modelpool):
        # FusionBench 0.2.33's CLIPVisionModelPool.load_processor reads the processor anew at each call (half a
        # second, its tokenizer included): read once per pool, not once per task
        if self._processor_of[0] is not modelpool:
            self._processor_of = (modelpool, modelpool.load_processor())
        return self._processor_of[1]

    def feature_site(self, modelpool, model):
        return CLIPImageFeatureSite(modelpool)
