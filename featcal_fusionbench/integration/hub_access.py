"""Every hub repository a run will read, checked with one metadata request each before anything is downloaded.

A misspelt id, a renamed dataset or a gated model otherwise surfaces minutes into a run, after the base and several
experts were downloaded, as a loader's error that names neither the option nor what to do. Here each model entry of
the pool (and its processor or tokenizer), each ``datasets.load_dataset`` entry, each calibration dataset and
``merged_model_path`` is checked first, and the error names the option, the id and the remedy. Offline
(``HF_HUB_OFFLINE``) nothing is asked; an unreachable hub leaves the loaders to fall back on the cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Iterator, List, Optional, Sequence, Set, Tuple

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from omegaconf import DictConfig, ListConfig, OmegaConf

from .glue import GLUE_HUB_ID

log = logging.getLogger(__name__)

# Our loaders that read a fixed hub dataset (their configs name no id), and the loaders whose `path` (or first
# positional argument) is a hub dataset id
_FIXED_DATASETS = {"featcal_fusionbench.integration.glue.load_glue_dataset": GLUE_HUB_ID}
_PATH_LOADERS = ("datasets.load_dataset", "featcal_fusionbench.integration.text_data.load_prompt_response")
_HUB_PREFIXES = ("hf://", "huggingface://")


def hub_id(value: Any) -> Optional[str]:
    """The hub id ``value`` names, or None when it is no string or an existing local path."""
    if not isinstance(value, str) or os.path.exists(value):
        return None
    for prefix in _HUB_PREFIXES:
        if value.startswith(prefix):
            return value[len(prefix):]
    return value


def check_path_option(option: str, value: Optional[str]) -> None:
    """A path option (a folder, a file, or a hub id) that is neither an existing path nor a well-formed hub id fails
    here, naming the option; whether a well-formed id exists is asked by ``check_hub_access``."""
    repo_id = hub_id(value)
    if repo_id is None:
        return
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise FileNotFoundError(
            f"{option}={value!r}: no such file or folder, and not a hub id (`name` or `namespace/name`)"
        ) from None


def _plain(config: Any) -> Any:
    """A config as plain values; None when it cannot be resolved on its own (an interpolation into its parent):
    the check then leaves it to the loader."""
    if isinstance(config, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(config, resolve=True)
        except Exception:  # omegaconf's resolution errors have no common base short of Exception
            return None
    return config


def _dataset_id(config: Any) -> Optional[str]:
    config = _plain(config)
    if not isinstance(config, Mapping):
        return None
    target = config.get("_target_")
    if target in _FIXED_DATASETS:
        return _FIXED_DATASETS[target]
    if target in _PATH_LOADERS:
        args = config.get("_args_") or []
        path = config.get("path", args[0] if args else None)
        if path in _local_builders():  # `json`, `parquet`, `imagefolder`, ... over local `data_files` / `data_dir`
            return None
        return hub_id(path)
    return None


def _local_builders() -> Set[str]:
    """The builders ``datasets.load_dataset`` takes by name for files (``json``, ``csv``, ``parquet``, ``arrow``,
    ``text``, ``imagefolder``, ...): no hub repository, though a name is what they are given."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return set(_PACKAGED_DATASETS_MODULES)


def _model_id(config: Any) -> Optional[str]:
    config = _plain(config)
    if isinstance(config, Mapping):
        config = config.get("pretrained_model_name_or_path")
    return hub_id(config)


def pool_sources(modelpool, calibration_datasets: Optional[Mapping] = None,
                 tasks: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, str, str]]:
    """(option, hub id, repo type) for every hub repository the pool names, and the calibration data of ``tasks``
    (default: every entry; a config may list datasets for experts the pool does not hold)."""
    for name, config in (getattr(modelpool, "_models", None) or {}).items():
        repo_id = _model_id(config)
        if repo_id:
            yield f"modelpool.models.{name}", repo_id, "model"
    for attr in ("processor", "tokenizer"):
        repo_id = _model_id(getattr(modelpool, f"_{attr}", None))
        if repo_id:
            yield f"modelpool.{attr}", repo_id, "model"
    for split in ("train", "val", "test"):
        for name, config in (getattr(modelpool, f"_{split}_datasets", None) or {}).items():
            repo_id = _dataset_id(config)
            if repo_id:
                yield f"modelpool.{split}_datasets.{name}", repo_id, "dataset"
    for name, config in (calibration_datasets or {}).items():
        if tasks is not None and name not in tasks:
            continue
        repo_id = _dataset_id(config)
        if repo_id:
            yield f"method.calibration_datasets.{name}", repo_id, "dataset"


def check_hub_access(sources) -> None:
    """One ``repo_info`` per distinct repository (and an ``auth_check`` for a gated one); the first missing one, or
    gated one this machine's token may not read, fails the run, named."""
    if constants.HF_HUB_OFFLINE:
        return
    api = HfApi()
    seen: Set[Tuple[str, str]] = set()
    for option, repo_id, repo_type in sources:
        if (repo_id, repo_type) in seen:
            continue
        seen.add((repo_id, repo_type))
        page = f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
        try:
            # The hub serves a gated repository's info to anyone and refuses only its files (huggingface_hub issue
            # #2457; datasets PR #7110 asks /auth-check for that reason): access is asked where it is enforced.
            if api.repo_info(repo_id, repo_type=repo_type).gated:
                api.auth_check(repo_id, repo_type=repo_type)
        except GatedRepoError:
            raise PermissionError(
                f"{option}: {repo_id!r} is a gated {repo_type} on the Hugging Face hub. Accept its conditions at "
                f"{page} with your account, then log in on this machine (`huggingface-cli login`, or set HF_TOKEN "
                f"to a token of that account) and run again."
            ) from None
        except RepositoryNotFoundError:
            raise FileNotFoundError(
                f"{option}: {repo_id!r} is neither a local path nor a {repo_type} on the Hugging Face hub "
                f"({constants.ENDPOINT}). Check the id (a private repository answers the same without a token)."
            ) from None
        except (HFValidationError, ValueError) as error:
            raise FileNotFoundError(f"{option}: {repo_id!r} is not a local path nor a hub id: {error}") from None
        except OSError as error:  # no connection: the loaders fall back on the local cache
            log.warning("could not reach the hub to check %s (%s): %s", option, repo_id, error)
            return


def loaded_files(repo_id: str) -> List[str]:
    """The patterns of the files ``from_pretrained`` reads from a model repository: configs, tokenizer and processor
    files, and one weight format (safetensors where the repository has it, else PyTorch's .bin)."""
    files = [s.rfilename for s in HfApi().model_info(repo_id).siblings or []]
    safetensors = any(f.endswith(".safetensors") for f in files)
    weights = ["*.safetensors", "*.safetensors.index.json"] if safetensors else ["pytorch_model*.bin",
                                                                                 "pytorch_model.bin.index.json"]
    return ["*.json", "*.txt", "*.model", *weights]


def fetch_only_loaded_files(modelpool) -> None:
    """FusionBench's ``CLIPVisionModelPool`` fetches each hub id it holds as a string (models, processor) with
    ``snapshot_download``: the whole repository. ``openai/clip-vit-base-patch32``'s main branch holds its weights
    for PyTorch, TensorFlow and Flax (1.8 GB, of which a torch run loads 0.6). Each such entry is fetched here with
    the files ``from_pretrained`` reads and replaced by the local snapshot, which the pool then uses as it is."""
    from fusion_bench.modelpool import CLIPVisionModelPool

    if constants.HF_HUB_OFFLINE or not isinstance(modelpool, CLIPVisionModelPool):
        return
    if getattr(modelpool, "_platform", "hf") not in ("hf", "huggingface"):
        return

    def snapshot(value) -> Optional[str]:
        repo_id = hub_id(value)
        return None if repo_id is None else snapshot_download(repo_id, allow_patterns=loaded_files(repo_id))

    for name in list(modelpool._models):
        local = snapshot(modelpool._models[name])
        if local is not None:
            modelpool._models[name] = local
    local = snapshot(getattr(modelpool, "_processor", None))
    if local is not None:
        modelpool._processor = local
