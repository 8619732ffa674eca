"""OpenCLIP vision towers: open_clip's ``VisionTransformer``, as FusionBench's ``OpenCLIPVisionModelPool`` serves it
(``fusion_bench.models.open_clip.ImageEncoder``, whose ``.model`` is an open_clip ``CLIP``), or the bare tower / CLIP.

conv1, the class token, the positional embedding and ``ln_pre`` enter the first residual block; ``ln_post`` and
``proj`` keep their merged values. In a block, q, k and v are rows of the fused ``attn.in_proj_weight`` (one shared
input, ``ln_1``'s output) and ``out_proj``'s input exists only inside the functional attention call
(``MHAOutProjSite`` recomputes it). Surgery's and ProbSurgery's maps act on the encoder's output (``feature_site``);
they are applied when the task pool names the task (``featcal_fusionbench.integration.openclip_pools.OpenCLIPTaskPool``).

open_clip 3.x (3.3.0 checked) builds ``ViT-B-32`` with ``nn.GELU``, while the OpenAI weights and the task-vector checkpoints were
trained with QuickGELU: ``check_models`` refuses such a pool (see ``activation_mismatch``);
``featcal_fusionbench.integration.openclip_pools.OpenCLIPPool`` builds the encoders with the right one.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from ..models.task_switch import EncoderOutputSurgery, unit
from . import register_family
from .base import FeatureSite, ImagesOnly, ModelFamily, batch_loader
from .clip_vision import LastBlockPatchWeighting
from .sites import SCALE, LayerNormSite, LinearSite, MHAOutProjSite, NormSite, mha_in_proj_sites

try:  # open_clip is a dependency of the package, but an import failure must not hide the other families
    import open_clip
    from open_clip.transformer import LayerScale, QuickGELU, ResidualAttentionBlock, VisionTransformer
except ImportError:  # pragma: no cover - exercised only without open_clip
    open_clip = None


def image_encoder_class():
    """FusionBench's ImageEncoder (what the OpenCLIP pool returns), or None where it cannot be imported."""
    try:
        from fusion_bench.models.open_clip import ImageEncoder
    except ImportError:  # pragma: no cover
        return None
    return ImageEncoder


def vision_tower(model: nn.Module) -> Optional[nn.Module]:
    """The ``VisionTransformer`` inside an ImageEncoder, an open_clip CLIP, or the tower itself; else None."""
    if open_clip is None:
        return None
    encoder = image_encoder_class()
    if encoder is not None and isinstance(model, encoder):
        model = model.model
    if isinstance(model, (open_clip.CLIP, open_clip.CustomTextCLIP)):
        model = model.visual
    return model if isinstance(model, VisionTransformer) else None


def activation_of(tower: nn.Module) -> type:
    """The MLP activation class of the tower's blocks (all blocks are built with one ``act_layer``)."""
    kinds = {type(block.mlp.gelu) for block in tower.transformer.resblocks}
    if len(kinds) != 1:
        raise TypeError(f"the OpenCLIP blocks mix MLP activations {sorted(k.__name__ for k in kinds)}")
    return kinds.pop()


def trained_with_quick_gelu(model_name: str) -> Optional[bool]:
    """Whether the weights FusionBench's ``ImageEncoder(model_name)`` reads were trained with QuickGELU: a
    ``-quickgelu`` name says so; otherwise open_clip's pretrained table for the tag (``openai`` unless the name
    carries ``__pretrained__<tag>``). None where unknown (``__init__``: random weights; an unknown tag)."""
    if "__init__" in model_name:
        return None
    name, _, tag = model_name.partition("__pretrained__")
    if "quickgelu" in name.lower():
        return True
    cfg = open_clip.get_pretrained_cfg(name, tag or "openai")
    return cfg.get("quick_gelu", False) if cfg else None


def activation_mismatch(entry: Any, tower: nn.Module) -> Optional[str]:
    """A message when a pool entry's weights were trained with another activation than the loaded tower uses."""
    model_name = entry.get("model_name") if hasattr(entry, "get") else None
    if not isinstance(model_name, str):
        return None  # a pickled encoder or a custom loader: its modules are what it was saved with
    quick = trained_with_quick_gelu(model_name)
    actual = activation_of(tower)
    if quick is None or (actual is QuickGELU) == quick:
        return None
    trained = "QuickGELU" if quick else "GELU"
    return (
        f"the pool's models are built as open_clip {model_name!r} with {actual.__name__}, but their weights were "
        f"trained with {trained} (open_clip {open_clip.__version__} builds the OpenAI architectures with nn.GELU; "
        f"the OpenAI weights and the task-vector checkpoints use QuickGELU). Every feature, the upstream merge's "
        f"and FeatCal's alike, would shift silently. Fix: load the pool with "
        f"featcal_fusionbench.integration.openclip_pools.OpenCLIPPool (the configs modelpool=OpenCLIPVisionModelPool/"
        f"<model>_TA8_quickgelu), which builds each encoder with the activation its weights were trained with "
        f"(FusionBench's ImageEncoder(model_name) has no switch for it)."
    )


#: the family option ``surgery_feature``: what Surgery's and ProbSurgery's maps read
SURGERY_FEATURES = ("encoder_output", "normalized")


class OpenCLIPImageFeatureSite(FeatureSite):
    """The image encoder's output: the projected image feature (``encode_image``), not normalised by default:
    Surgery's original code maps this feature of the task-vector encoders, and the task's ``ClassificationHead``
    (which normalises) reads the mapped feature. ``normalized``: the unit-normalised feature, HF CLIP's site in
    FusionBench's protocol, so that both families train the same maps (docs/families/openclip_vision.md)."""

    def __init__(self, tower: nn.Module, normalized: bool = False):
        self.dim = tower.proj.shape[1] if tower.proj is not None else tower.transformer.width
        self.normalized = normalized

    def features(self, model: nn.Module, images: Tensor) -> Tensor:
        features = vision_tower(model)(images)  # what ImageEncoder.forward returns, for a bare tower or CLIP too
        return unit(features) if self.normalized else features

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        # FusionBench's task pool calls the encoder inside ImageClassifier without the task: the map is applied on
        # its output for the task the task pool sets.
        return EncoderOutputSurgery(wrapper, normalize=self.normalized)


class LayerScaleSite(NormSite):
    """open_clip's ``LayerScale`` (``x * gamma``): an elementwise scale of the raw input, solved like a scale-only
    norm with the identity as normaliser."""

    kind = SCALE

    @property
    def weight(self):
        return self.module.gamma

    @property
    def bias(self):
        return None

    def write(self, weight=None, bias=None):
        if weight is not None:
            with torch.no_grad():
                self.module.gamma.copy_(weight.to(dtype=self.module.gamma.dtype, device=self.module.gamma.device))

    @property
    def dim(self) -> int:
        return self.module.gamma.shape[0]

    def normalizer(self):
        return lambda x: x

    def hooks(self, on_input, on_output=None):
        # An in-place LayerScale overwrites its input after the hook: keep a copy of what it was.
        if getattr(self.module, "inplace", False):
            return super().hooks(lambda x: on_input(x.clone()), on_output)
        return super().hooks(on_input, on_output)


@register_family
class OpenCLIPVisionFamily(LastBlockPatchWeighting, ModelFamily):
    """Options: ``last_block_patch_token_weight``, exactly as in the HF CLIP family (``LastBlockPatchWeighting``);
    ``surgery_feature`` (``encoder_output``, the default, or ``normalized``): the feature Surgery's and
    ProbSurgery's maps read (``OpenCLIPImageFeatureSite``)."""

    name = "openclip_vision"
    kv_sites = ("attn.in_proj.k", "attn.in_proj.v")
    options = {**LastBlockPatchWeighting.options, "surgery_feature": "encoder_output"}

    def check_option(self, name, value):
        if name == "surgery_feature":
            if value not in SURGERY_FEATURES:
                return f"surgery_feature must be one of {list(SURGERY_FEATURES)}, got {value!r}"
            return None
        return super().check_option(name, value)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return vision_tower(model) is not None

    @staticmethod
    def tower(model: nn.Module) -> nn.Module:
        tower = vision_tower(model)
        if tower is None:
            raise TypeError(f"{type(model).__name__} holds no open_clip VisionTransformer")
        unsupported = [
            what for what, present in (
                ("an attentional pooler", getattr(tower, "attn_pool", None) is not None),
                ("custom residual blocks (qk-norm, scaled cosine attention, ...)",
                 any(not isinstance(b, ResidualAttentionBlock) for b in tower.transformer.resblocks)),
            ) if present
        ]
        if unsupported:
            raise NotImplementedError(f"the openclip_vision family does not calibrate towers with {' or '.join(unsupported)}")
        return tower

    # ---- the block walk ------------------------------------------------------------------------

    def blocks(self, model):
        return list(self.tower(model).transformer.resblocks)

    def stem_modules(self, model):
        tower = self.tower(model)
        # class_embedding and positional_embedding are parameters of the tower itself, which holds the blocks:
        # they are not moved as modules but read onto the device in embed (two small tensors).
        return [tower.conv1, tower.ln_pre]

    def embed(self, model, inputs) -> Tuple[Tensor, bool]:
        """open_clip's ``VisionTransformer._embeds`` (3.3.0), written out so that towers unpickled from older
        open_clip versions (no ``_embeds``, no ``patch_dropout``) walk the same way. The metadata is whether the
        blocks read (N, L, D) (open_clip >= 2.23) or (L, N, D) (older pickles, attention not batch_first)."""
        tower = self.tower(model)
        x = tower.conv1(inputs.to(tower.conv1.weight.dtype))
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        cls = tower.class_embedding.to(x).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + tower.positional_embedding.to(x)
        x = getattr(tower, "patch_dropout", nn.Identity())(x)  # the identity in eval mode
        x = tower.ln_pre(x)
        batch_first = tower.transformer.resblocks[0].attn.batch_first
        return (x if batch_first else x.transpose(0, 1)), batch_first

    def run_block(self, block, hidden, meta):
        return block(hidden)

    # ---- what is calibrated --------------------------------------------------------------------

    def sites(self, block):
        found = {"ln_1": LayerNormSite(block.ln_1)}
        found.update({f"attn.in_proj.{part}": site for part, site in mha_in_proj_sites(block.attn).items()})
        found["attn.out_proj"] = MHAOutProjSite(block.attn)
        if isinstance(block.ls_1, LayerScale):
            found["ls_1"] = LayerScaleSite(block.ls_1)
        found["ln_2"] = LayerNormSite(block.ln_2)
        found["mlp.c_fc"] = LinearSite(block.mlp.c_fc)
        found["mlp.c_proj"] = LinearSite(block.mlp.c_proj)
        if isinstance(block.ls_2, LayerScale):
            found["ls_2"] = LayerScaleSite(block.ls_2)
        return found

    def token_axis(self, batch_first: bool) -> int:
        return 1 if batch_first else 0

    # ---- checks, data, the baselines -----------------------------------------------------------

    def check_models(self, modelpool, model) -> None:
        tower = self.tower(model)
        config = getattr(modelpool, "get_model_config", None)
        if config is None:
            return
        for name in ["_pretrained_", *modelpool.model_names] if modelpool.has_pretrained else modelpool.model_names:
            problem = activation_mismatch(config(name), tower)
            if problem:
                raise ValueError(f"pool entry {name!r}: {problem}")

    def batches(self, modelpool, dataset, batch_size, shuffle=False, seed=0) -> Iterator[Tensor]:
        """Images through the pool's evaluation transform (the encoder's ``val_preprocess``): the features the
        task pool classifies, without the training transform's random crops."""
        from fusion_bench.dataset.image_dataset import ImageClassificationDataset

        processor = getattr(modelpool, "test_processor", None)
        if processor is None:
            raise TypeError(
                f"OpenCLIP calibration images are transformed by the pool's `test_processor` (an "
                f"OpenCLIPVisionModelPool); got a {type(modelpool).__name__}"
            )
        images = batch_loader(ImageClassificationDataset(ImagesOnly(dataset), processor), batch_size, shuffle, seed)
        return (pixels for pixels, _labels in images)

    def feature_site(self, modelpool, model):
        return OpenCLIPImageFeatureSite(self.tower(model), self.option_values["surgery_feature"] == "normalized")
