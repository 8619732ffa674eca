"""FusionBench's OpenCLIP model pool and task pool, as they are, with the two things the task-vector checkpoints need.

- ``OpenCLIPPool`` builds each ``{model_name, pickle_path}`` / ``{model_name, state_dict_path}`` entry with the
  activation its weights were trained with (QuickGELU for the OpenAI weights and the task-vector checkpoints) and
  without downloading the pretrained weights the checkpoint replaces. FusionBench's ``ImageEncoder(model_name)`` builds
  them with open_clip 3.x's ``nn.GELU``. Every other entry, the classification heads and the datasets are
  FusionBench's.
- ``OpenCLIPTaskPool`` sets the evaluated model's ``active_task`` while it evaluates each test dataset, so that
  Surgery's and ProbSurgery's per-task maps apply (``EncoderOutputSurgery``); FusionBench's task pool never names the
  task to the model.

Importing this module makes ``typing.override`` available on Python < 3.12 (``compat.backport_typing_override``)
before FusionBench's OpenCLIP modules are imported: they cannot be imported otherwise.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple
from unittest import mock

import open_clip
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from .compat import backport_typing_override
from .upstream import load_torch_file

backport_typing_override()

from fusion_bench.modelpool.openclip_vision.modelpool import (  # noqa: E402
    OpenCLIPVisionModelPool,
    _check_and_redirect_open_clip_modeling,
)
from fusion_bench.models.open_clip import ImageEncoder  # noqa: E402
from fusion_bench.models.open_clip.variables_and_paths import CACHEDIR  # noqa: E402
from fusion_bench.taskpool.openclip_vision.openclip_taskpool import (
    OpenCLIPVisionModelTaskPool,  # noqa: E402
)
from fusion_bench.utils.expr import is_expr_match  # noqa: E402
from transformers.modeling_utils import no_init_weights  # noqa: E402

from ..families.openclip_vision import trained_with_quick_gelu  # noqa: E402
from ..models.task_switch import active_task  # noqa: E402

__all__ = ["CheckpointImageEncoder", "OpenCLIPPool", "OpenCLIPTaskPool", "build_arguments"]

# open_clip pretrained-table keys -> create_model_and_transforms arguments: the transforms ImageEncoder(model_name)
# gets from the pretrained tag it downloads.
_PREPROCESS_ARGUMENTS = {"mean": "image_mean", "std": "image_std", "interpolation": "image_interpolation",
                         "resize_mode": "image_resize_mode"}


def build_arguments(model_name: str) -> Tuple[str, Dict[str, Any]]:
    """The open_clip architecture and ``create_model_and_transforms`` arguments (no weights) for a FusionBench model
    name (``<arch>``: the OpenAI weights; ``<arch>__pretrained__<tag>``; ``<arch>__init__``: random weights): the
    activation the named weights were trained with, and their tag's image transforms."""
    if "__pretrained__" in model_name:
        name, tag = model_name.split("__pretrained__")
    elif "__init__" in model_name:
        name, tag = model_name.split("__init__")[0], None
    else:
        name, tag = model_name, "openai"
    if open_clip.get_model_config(name) is None:
        raise ValueError(f"pool model_name {model_name!r}: open_clip {open_clip.__version__} has no model {name!r}")
    kwargs: Dict[str, Any] = {}
    if tag is not None:
        pretrained = open_clip.get_pretrained_cfg(name, tag)
        if not pretrained:
            raise ValueError(
                f"pool model_name {model_name!r}: open_clip has no pretrained tag {tag!r} for {name!r}, so the "
                f"activation and transforms its weights were trained with are unknown; known tags: "
                f"{open_clip.list_pretrained_tags_by_model(name)}"
            )
        kwargs.update({arg: pretrained[key] for key, arg in _PREPROCESS_ARGUMENTS.items() if key in pretrained})
        kwargs["force_quick_gelu"] = bool(trained_with_quick_gelu(model_name))
    return name, kwargs


class CheckpointImageEncoder(ImageEncoder):
    """FusionBench's ``ImageEncoder`` with random weights, to load a checkpoint into: built with the activation the
    named weights were trained with (``build_arguments``) and without downloading them."""

    def __init__(self, model_name: str, keep_lang: bool = False):
        nn.Module.__init__(self)  # not ImageEncoder.__init__: it downloads the weights and builds nn.GELU
        name, kwargs = build_arguments(model_name)
        self.model, self.train_preprocess, self.val_preprocess = open_clip.create_model_and_transforms(
            name, pretrained=None, **kwargs
        )
        self.cache_dir = CACHEDIR
        if not keep_lang and hasattr(self.model, "transformer"):
            delattr(self.model, "transformer")  # as ImageEncoder does: the text tower is not used


def read_pickled_encoder(path: str) -> nn.Module:
    """A task-vector checkpoint: a whole pickled ``ImageEncoder`` of open_clip 2.0.2 (loading it runs its pickle, as
    FusionBench's loader does; a weights-only load cannot read a pickled module)."""
    _check_and_redirect_open_clip_modeling()  # maps the pickles' `src.modeling` and open_clip 2.0.2 class paths
    return load_torch_file(path, weights_only=False)


class OpenCLIPPool(OpenCLIPVisionModelPool):
    """``OpenCLIPVisionModelPool`` whose ``{model_name, pickle_path}`` and ``{model_name, state_dict_path}`` entries
    are built as ``CheckpointImageEncoder(model_name)`` (the activation the weights were trained with) before the
    checkpoint's state dict is loaded into them. Configs: ``modelpool=OpenCLIPVisionModelPool/<model>_TA8_quickgelu``."""

    def _entry(self, model_name_or_config) -> Any:
        if isinstance(model_name_or_config, str) and model_name_or_config in self._models:
            model_name_or_config = self._models[model_name_or_config]
        if isinstance(model_name_or_config, DictConfig):
            return OmegaConf.to_container(model_name_or_config, resolve=True)
        return model_name_or_config

    def load_model(self, model_name_or_config, *args, **kwargs):
        entry = self._entry(model_name_or_config)
        if is_expr_match({"model_name": str, "pickle_path": str}, entry):
            read = lambda: read_pickled_encoder(entry["pickle_path"]).state_dict()  # noqa: E731
        elif is_expr_match({"model_name": str, "state_dict_path": str}, entry):
            read = lambda: load_torch_file(entry["state_dict_path"], weights_only=True)  # noqa: E731
        else:
            return super().load_model(model_name_or_config, *args, **kwargs)
        # a bad name fails before the checkpoint is read; the strict load below replaces every parameter and
        # stored buffer, so their random initialization (most of the build's time) is skipped, and the read tensors
        # are taken as they are (``assign``) rather than copied into the built ones (a ViT-B/32 is 350 MB to touch)
        with no_init_weights(), mock.patch.object(nn.MultiheadAttention, "_reset_parameters", lambda self: None):
            # transformers patches torch.nn.init's functions; MultiheadAttention calls the xavier_uniform_ it
            # imported, so its own initialization is skipped here
            encoder = CheckpointImageEncoder(entry["model_name"])
        built = encoder.state_dict()
        state = {k: v.to(built[k].dtype) if k in built and v.dtype != built[k].dtype else v for k, v in read().items()}
        encoder.load_state_dict(state, assign=True)
        # FusionBench's own branch for a built module: it keeps the first encoder's transforms for the data.
        return super().load_model(encoder, *args, **kwargs)


class OpenCLIPTaskPool(OpenCLIPVisionModelTaskPool):
    """``OpenCLIPVisionModelTaskPool`` that sets the evaluated model's ``active_task`` to each test dataset's name
    while it evaluates that dataset. Configs: ``taskpool=OpenCLIPVisionModelTaskPool/<model>_TA8_active_task``."""

    _evaluated: Optional[nn.Module] = None

    def evaluate(self, model, **kwargs):
        # FusionBench evaluates ImageClassifier(fabric-wrapped model, head); the task is set on the model itself.
        self._evaluated = model
        try:
            return super().evaluate(model, **kwargs)
        finally:
            self._evaluated = None

    def _evaluate(self, classifier, test_loader, num_classes: int, task_name: str):
        with active_task(self._evaluated, task_name):
            return super()._evaluate(classifier, test_loader, num_classes=num_classes, task_name=task_name)
