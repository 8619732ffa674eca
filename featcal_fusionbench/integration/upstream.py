"""Getting the upstream merged model that a post-merging method starts from.

Three sources, in this order of precedence: a saved model path, a ``_merged_``
entry in the pool, or a nested FusionBench method config that is run on the
pool (FusionBench's own "base method, then calibrate" pattern).
"""

from __future__ import annotations

import copy
import logging
import zipfile
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from ..models.checks import (check_checkpoint_matches, check_pool_checkpoint, check_same_state,
                             checkpoint_architectures, warn_config_differences)

log = logging.getLogger(__name__)


def instantiate_upstream(upstream: Any, parent: Any):
    """Build the upstream method and hand it the parent's Fabric and program."""
    from fusion_bench.utils.instantiate_utils import instantiate

    if isinstance(upstream, (dict, DictConfig)):
        if "_target_" not in upstream:
            raise ValueError(f"the upstream method config has no `_target_`: {dict(upstream)}")
        method = instantiate(upstream, _recursive_=False)
    else:
        method = upstream
    if not callable(getattr(method, "run", None)):
        raise TypeError(f"the upstream method {type(method).__name__} has no run(modelpool)")
    for attr in ("_fabric_instance", "_program"):
        if hasattr(method, attr) and getattr(parent, attr, None) is not None:
            setattr(method, attr, getattr(parent, attr))
    return method


# FusionBench 0.2.33's method classes whose run(modelpool) does not return one merged model of the pool's
# architecture, and what they return instead (read from each class's run(); experiments/results/upstreams.md lists
# every method config with its file and line). Any other class is taken as a merger; its output is checked when it
# returns (``check_same_architecture``).
NOT_ONE_MERGED_MODEL = {
    **dict.fromkeys([
        "MixtralForCausalLMUpscalingAlgorithm", "MixtralMoEMergingAlgorithm", "MixtralUpscalingAlgorithm",
        "SmileUpscalingAlgorithm", "SmileCausalLMUpscalingAlgorithm", "SmileMistralUpscalingAlgorithm",
        "SmileQwen2UpscalingAlgorithm", "CLIPWeightEnsemblingMoEAlgorithm", "SparseCLIPWeightEnsemblingMoEAlgorithm",
        "FlanT5WeightEnsemblingMoEAlgorithm", "CLIPRankOneMoEAlgorithm", "PWEMoEExactParetoOptimalForOpenCLIP",
        "PWEMoELinearScalarizationForOpenCLIP", "DepthUpscalingAlgorithm"],
        "an upscaled model (mixture of experts or added layers), not one model of the pool's architecture"),
    **dict.fromkeys([
        "SimpleEnsembleAlgorithm", "WeightedEnsembleAlgorithm", "MaxModelPredictorAlgorithm",
        "DataAdaptiveWeightEnsemblingForCLIP", "EMRMerging", "TallMaskTaskArithmeticAlgorithm",
        "ResNetTaskWiseAdamerging"],
        "an ensemble or a model with per-task parts, not one model of the pool's architecture"),
    **dict.fromkeys([
        "PWEMoELinearScalarizationForCLIP", "SuperposedModelSoupAlgorithm", "SuperposedTaskArithmeticAlgorithm",
        "SuperposedTaskArithmeticLoRAAlgorithm", "CLIPLayerWiseGossipAlgorithm", "FlanT5LayerWiseGossipAlgorithm",
        "CLIPLayerWiseAdaMergingSurgeryAlgorithm", "ModelRecombinationAlgorithm"],
        "several models, a dict or a model pool, not one merged model"),
    **dict.fromkeys([
        "ImageClassificationFineTuningForCLIP", "ContinualImageClassificationFineTuningForCLIP",
        "ImageClassificationFineTuning", "ImageClassificationFineTuning_Test", "FullFinetuneSFT", "PeftFinetuneSFT",
        "BradleyTerryRewardModeling"],
        "a fine-tuned model: it trains, it does not merge the pool's experts"),
    **dict.fromkeys([
        "MagnitudePruningForLlama", "RandomPruningForLlama", "SparseGPTPruningForLlama", "WandaPruningForLlama",
        "MagnitudeDiffPruningAlgorithm", "SparseLoForLlama", "IterativeSparseLoForLlama", "PCPSparseLoForLlama",
        "LayerWisePruningForMixtral", "MoEPruner", "BitDeltaAlgorithm"],
        "a pruned or compressed model: it compresses, it does not merge the pool's experts"),
    **dict.fromkeys([
        "TaskVectorCosSimilarity", "TaskVectorViolinPlot", "ErrorAccumulationAnalysisForCLIP",
        "ProjectedEnergyAnalysis"],
        "an analysis: no merged model"),
}


def upstream_class_name(upstream: Any) -> Optional[str]:
    """The class an upstream config names (its ``_target_``'s last part) or an instantiated upstream's."""
    if isinstance(upstream, (dict, DictConfig)):
        target = upstream.get("_target_")
        return None if not isinstance(target, str) else target.rsplit(".", 1)[-1]
    return None if upstream is None else type(upstream).__name__


def check_upstream_merger(upstream: Any, method_name: str) -> None:
    """Refuse, before any work, an upstream whose output the post-merging method cannot take."""
    if upstream is None:
        return
    if isinstance(upstream, (dict, DictConfig)) and not isinstance(upstream.get("_target_"), str):
        raise ValueError(
            f"the upstream method config has no `_target_` (FusionBench's configs of the older `name:` form are "
            f"not instantiable): {dict(upstream)}")
    name = upstream_class_name(upstream)
    if name in NOT_ONE_MERGED_MODEL:
        raise ValueError(
            f"the upstream method {name} returns {NOT_ONE_MERGED_MODEL[name]}; {method_name} calibrates one merged "
            f"model of the pool's architecture: choose a merger (method/upstream=task_arithmetic, ties_merging, "
            f"regmean_plusplus/clip_regmean_plusplus, ...)")


def describe_upstream(upstream: Any) -> str:
    if isinstance(upstream, (dict, DictConfig)):
        return str(upstream.get("_target_"))
    return type(upstream).__name__


def check_upstream_source(modelpool, upstream: Any, merged_model_path: Optional[str]) -> None:
    """Fail before any heavy work when no source of the merged model is given."""
    if merged_model_path is None and not modelpool.has_merged and upstream is None:
        raise ValueError(
            "no upstream merged model: set `upstream` to a FusionBench method config, "
            "add `_merged_` to the model pool, or set `merged_model_path`"
        )


def load_saved_model(path: str, reference: nn.Module, device_map: Any = None) -> nn.Module:
    """A merged model saved by FusionBench's ``merged_model_save_path`` or by another merger (mergekit): a
    ``save_pretrained`` folder or hub id (HF models; a local safetensors one is checked against ``reference``'s tensor
    names and shapes before any tensor is read), or a state dict file (below). ``device_map``: ``from_pretrained``'s,
    for a model larger than one device."""
    if Path(path).is_file():
        return load_state_dict_file(path, reference)
    loader = getattr(type(reference), "from_pretrained", None)
    if loader is not None:
        check_checkpoint_matches(path, reference, "merged_model_path")
        kwargs = {}
        if type(reference).__name__ in checkpoint_architectures(path):
            # the base's architecture settings: a config.json written by transformers 5 (mergekit 0.1.5) keeps
            # rope_theta in rope_parameters, which 4.x ignores, falling back to 10000 without a word
            warn_config_differences(path, reference, "merged_model_path")
            kwargs["config"] = copy.deepcopy(reference.config)
        # In the base's dtype: from_pretrained's default is float32, which would double a bf16 LLM.
        dtype = getattr(reference, "dtype", None)
        if isinstance(dtype, torch.dtype):
            kwargs["torch_dtype"] = dtype
        if device_map is not None:
            kwargs["device_map"] = device_map
        return loader(path, **kwargs)
    raise FileNotFoundError(
        f"merged_model_path {path!r}: a {type(reference).__name__} has no from_pretrained, so a saved one is the "
        f"state dict file FusionBench's model pool writes (torch.save), and there is no such file")


def load_torch_file(path: str, weights_only: bool):
    """``torch.load`` onto the CPU, its tensors mapped from the file where it is a zip archive (torch.save's format
    since torch 1.6): the loaded tensors are then the file's pages, read once, not a copy of each into fresh memory
    (most of a full-width load's time: 16 OpenCLIP ViT-B/32 checkpoints in a Task Arithmetic run that FeatCal
    follows). Private mapping: writing to a loaded tensor never reaches the file. The legacy format is read whole."""
    if zipfile.is_zipfile(path):
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def load_state_dict_file(path: str, reference: nn.Module) -> nn.Module:
    """A copy of ``reference`` (the base: same class and keys) holding the state dict in file ``path``: what
    ``BaseModelPool.save_model`` writes (``torch.save``) for every pool that does not save otherwise, OpenCLIP's
    ``ImageEncoder`` and FusionBench 0.2.33's ``Seq2SeqLMPool`` among them (fusion_bench/modelpool/seq2seq_lm has
    no ``save_model``), or a single ``.safetensors`` file. Its names and shapes must be the base's, checked before the
    copy."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        try:
            state = load_torch_file(path, weights_only=True)
        except Exception as error:
            raise ValueError(f"merged_model_path {path!r}: a file, but not a state dict torch.load reads "
                             f"({type(error).__name__}: {error})") from None
    if not isinstance(state, dict):
        raise ValueError(f"merged_model_path {path!r}: holds a {type(state).__name__}, not a state dict")
    check_same_state(reference.state_dict(), state, f"merged_model_path {path!r}")
    merged = copy.deepcopy(reference)
    merged.load_state_dict(state)
    return merged


def load_merged_model(
    modelpool, upstream: Any, merged_model_path: Optional[str], parent: Any, reference: nn.Module
) -> Tuple[nn.Module, str]:
    """Return (merged model, a description of where it came from)."""
    check_upstream_source(modelpool, upstream, merged_model_path)
    if merged_model_path is not None:
        if upstream is not None or modelpool.has_merged:
            log.warning("merged_model_path is set: the upstream method and any `_merged_` entry are not used")
        return load_saved_model(merged_model_path, reference), f"path:{merged_model_path}"
    if modelpool.has_merged:
        if upstream is not None:
            log.warning("the pool has `_merged_`: the upstream method config is not run")
        check_pool_checkpoint(modelpool, "_merged_", reference, "the pool's `_merged_`")
        return modelpool.load_model("_merged_"), "pool:_merged_"
    method = instantiate_upstream(upstream, parent)
    log.info("running the upstream merger %s", describe_upstream(upstream))
    merged = method.run(modelpool)
    if isinstance(merged, dict):
        raise TypeError(
            f"the upstream method {describe_upstream(upstream)} returned a dict; FeatCal needs one merged model"
        )
    return merged, f"method:{describe_upstream(upstream)}"
