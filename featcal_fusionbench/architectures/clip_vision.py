"""HF ``CLIPVisionModel`` (and its bare ``CLIPVisionTransformer``)."""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import CLIPVisionModel
from transformers.models.clip.modeling_clip import CLIPVisionTransformer

from .base import UNIFORM, ArchitectureAdapter

CLS_WEIGHTED = "cls-weighted"
# k and v of patch tokens still feed the CLS token's attention in the last block,
# so they keep uniform weights even when the other modules down-weight patches.
_KV_MODULES = ("self_attn.k_proj", "self_attn.v_proj")


class CLIPVisionAdapter(ArchitectureAdapter):
    """Embeddings and ``pre_layrnorm`` enter the first block; ``post_layernorm`` is left as merged.

    Args:
        last_block_patch_token_weight: weight of patch tokens in the last block's
            statistics for every module but k/v (the CLS token keeps weight 1).
            1.0 is the paper's uniform weighting; the authors' demo uses 0.01,
            because only the CLS output of the last block reaches the pooled feature.
    """

    name = "clip_vision"

    def __init__(self, last_block_patch_token_weight: float = 1.0):
        self.last_block_patch_token_weight = float(last_block_patch_token_weight)

    @classmethod
    def from_hparams(cls, hparams) -> "CLIPVisionAdapter":
        return cls(last_block_patch_token_weight=hparams.last_block_patch_token_weight)

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

    def weight_profile(self, block_index: int, num_blocks: int, module_name: str) -> Hashable:
        if (
            block_index == num_blocks - 1
            and self.last_block_patch_token_weight != 1.0
            and module_name not in _KV_MODULES
        ):
            return CLS_WEIGHTED
        return UNIFORM

    def token_weights(self, profile, hidden, meta) -> Optional[Tensor]:
        if profile == UNIFORM:
            return None
        weights = torch.full(hidden.shape[:-1], self.last_block_patch_token_weight, device=hidden.device)
        weights[:, 0] = 1.0
        return weights

    def make_input_batches(self, modelpool, dataset, batch_size: int) -> Iterable[Tensor]:
        from fusion_bench.dataset.image_dataset import ImageClassificationDataset

        loader = DataLoader(
            ImageClassificationDataset(dataset, modelpool.load_processor()), batch_size=batch_size, shuffle=False
        )
        for pixel_values, _labels in loader:
            yield pixel_values
