"""Checks that the models FeatCal combines share one architecture."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Collection, List, Mapping

from torch import Tensor, nn

from .lazy import SAFETENSORS_FILE, SAFETENSORS_INDEX, CheckpointTensors, entry_path, safetensors_header, tied_names

log = logging.getLogger(__name__)


def check_same_architecture(reference: nn.Module, model: nn.Module, name: str,
                            shapes_may_differ: Collection[str] = ()) -> None:
    """Raise naming ``name`` when its class, parameter names or shapes differ from the reference; a shape of a key in
    ``shapes_may_differ`` (what the model's family never calibrates) may differ, and is logged."""
    if type(model) is not type(reference):
        raise ValueError(
            f"{name} is a {type(model).__name__}, but the pretrained model is a {type(reference).__name__}"
        )
    check_same_state(reference.state_dict(), model.state_dict(), name, shapes_may_differ)


def check_same_state(ref_state: Mapping[str, Tensor], state: Mapping[str, Tensor], name: str,
                     shapes_may_differ: Collection[str] = ()) -> None:
    """Raise naming ``name`` when ``state``'s names or shapes differ from the pretrained model's ``ref_state``
    (a model's, or a state dict read from a file, before it is loaded into a copy of the base)."""
    missing = [k for k in ref_state if k not in state]
    extra = [k for k in state if k not in ref_state]
    if missing or extra:
        raise ValueError(
            f"{name} has different parameters from the pretrained model "
            f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected: {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )
    for key, tensor in ref_state.items():
        if state[key].shape == tensor.shape:
            continue
        if key in shapes_may_differ:
            log.info("%s: %s is %s where the pretrained model has %s; tolerated: it is not calibrated", name, key,
                     tuple(state[key].shape), tuple(tensor.shape))
        else:
            raise ValueError(
                f"{name} has a different shape for {key}: {tuple(state[key].shape)} "
                f"where the pretrained model has {tuple(tensor.shape)}"
            )


def check_checkpoint_matches(folder, reference: nn.Module, name: str, shapes_may_differ: Collection[str] = ()) -> bool:
    """Raise naming the tensor when a safetensors checkpoint folder's tensor names or shapes differ from
    ``reference``'s, from the files' headers, before any tensor is read; ``shapes_may_differ`` as in
    ``check_same_architecture``; a tensor the reference lacks counts where the checkpoint was saved from the
    reference's class. ``from_pretrained`` would initialise a tensor the checkpoint lacks at random and pass over one
    it does not know, with a warning. Returns False (nothing checked) for a folder without safetensors."""
    folder = Path(folder)
    if not ((folder / SAFETENSORS_FILE).is_file() or (folder / SAFETENSORS_INDEX).is_file()):
        return False
    held = CheckpointTensors(folder).shapes()
    aliases = tied_names(reference)
    expected = {key: tuple(tensor.shape) for key, tensor in reference.state_dict().items()}
    found, problems = set(), []
    for key, shape in expected.items():
        stored = next((k for k in (key, *aliases.get(key, ())) if k in held), None)
        if stored is None:
            problems.append(f"{key} {shape} is missing")
            continue
        found.add(stored)
        if held[stored] != shape and key not in shapes_may_differ:
            problems.append(f"{stored} is {held[stored]} where the pretrained model has {shape}")
    # A checkpoint of a larger architecture (a full CLIPModel read as its vision tower) holds more, which
    # from_pretrained leaves out by design: extra tensors count only in a checkpoint of the reference's own class.
    if type(reference).__name__ in checkpoint_architectures(folder):
        problems += [f"{key} {held[key]} is not a tensor of the pretrained model" for key in sorted(set(held) - found)]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{name} at {folder} does not match the pretrained model: {'; '.join(problems[:5])}{more}")
    return True


def check_checkpoint_files(path) -> None:
    """A local safetensors checkpoint (a folder, one file or sharded, or a ``.safetensors`` file) whose files are cut
    short or damaged fails naming the file, from the headers alone (nothing is read beyond them); anything else
    (a hub id, another format) is left to its loader."""
    if path is None:
        return
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        with open(path, "rb") as f:
            safetensors_header(f, path)
    elif path.is_dir() and ((path / SAFETENSORS_FILE).is_file() or (path / SAFETENSORS_INDEX).is_file()):
        CheckpointTensors(path).shapes()


# config.json keys that say how a checkpoint was saved, not what the model computes
_SAVING_KEYS = {"_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version",
                "use_cache"}


def config_differences(folder, reference: nn.Module) -> List[str]:
    """The settings in a checkpoint folder's config.json that differ from ``reference``'s config (or that it has
    no such setting for), other than how it was saved; only for a checkpoint saved from the reference's own class
    (a full CLIP checkpoint read as its vision tower has another config by design)."""
    config = getattr(reference, "config", None)
    if config is None or type(reference).__name__ not in checkpoint_architectures(Path(folder)):
        return []
    saved = json.loads((Path(folder) / "config.json").read_text())
    own = json.loads(config.to_json_string(use_diff=False))
    return [f"{key}={saved[key]!r} " + (f"(the base: {own[key]!r})" if key in own else "(unknown to the base)")
            for key in sorted(set(saved) - _SAVING_KEYS) if own.get(key, object()) != saved[key]]


def warn_config_differences(folder, reference: nn.Module, name: str) -> None:
    """Log what ``config_differences`` finds: the merge is built from the base's config (``models.lazy.lazy_like``,
    ``integration.upstream.load_saved_model``), so such a setting is not used."""
    differences = config_differences(folder, reference)
    if differences:
        log.warning("%s at %s: its config.json differs from the base's, whose config is used (a merge has the base's "
                    "architecture): %s", name, folder, "; ".join(differences))


def checkpoint_architectures(folder) -> List[str]:
    """The classes a checkpoint's config.json says it was saved from."""
    try:
        return list(json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


def check_pool_checkpoint(modelpool, name: str, reference: nn.Module, label: str,
                          shapes_may_differ: Collection[str] = ()) -> bool:
    """``check_checkpoint_matches`` for the pool's model ``name`` where its entry is a local safetensors folder (a
    hub id, a live module, or a pool that does not say where its models are, is not checked here); before the pool
    loads it."""
    entry = getattr(modelpool, "get_model_config", None)
    path = None if entry is None else entry_path(entry(name, return_copy=False))
    return path is not None and check_checkpoint_matches(path, reference, label, shapes_may_differ)
