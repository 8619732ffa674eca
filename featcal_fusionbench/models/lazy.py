"""Base and expert models whose weights stay in their checkpoints until a block's turn comes.

FeatCal needs one block of the base and of each expert at a time (plus each expert's stem while its task's inputs
are embedded), so a *lazy* model is the model's skeleton with its parameters on the meta device, and each module
knows where its tensors are in the checkpoint (safetensors: one file, or shards with an HF index). The engine's
residency scope (``models.residency.on_device``) reads a lazy module's tensors onto the device when it enters and puts them
back on the meta device when it leaves, so host memory holds the merged model and the blocks in use, not whole
copies of the base and every expert.

Buffers are built for real (``init_empty_weights(include_buffers=False)``): non-persistent ones such as the rotary
``inv_freq`` are computed, not stored, and persistent ones are small.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointTensors:
    """Where each tensor of a safetensors checkpoint folder is, and reading a few of them at a time."""

    def __init__(self, folder):
        self.folder = Path(folder)
        index = self.folder / SAFETENSORS_INDEX
        single = self.folder / SAFETENSORS_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.folder / name for key, name in weight_map.items()}
        elif single.is_file():
            with open(single, "rb") as f:
                self.files = dict.fromkeys(safetensors_header(f, single)[0], single)
        else:
            raise FileNotFoundError(
                f"lazy loading reads safetensors checkpoints: {self.folder} has neither {SAFETENSORS_FILE} nor "
                f"{SAFETENSORS_INDEX} (a pool entry that is not such a folder is loaded whole with models_in_memory=all)"
            )

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor's shape, from the files' headers alone (no tensor is read)."""
        out = {}
        for path in sorted(set(self.files.values())):
            with open(path, "rb") as f:
                header, _ = safetensors_header(f, path)
            out.update({key: tuple(entry["shape"]) for key, entry in header.items()})
        return out

    def read(self, keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        """The tensors, each read from its file into a fresh allocation of its own. Not through a memory map: the
        mapped pages would count in the process's RSS beside the copies a model keeps (at 1B scale that doubled an
        expert's 0.5 GiB embedding while it was read), and a tensor would start wherever its bytes lie in the file,
        which can change MKL's kernel (``materialize``)."""
        by_file = defaultdict(list)
        for key in keys:
            by_file[self.files[key]].append(key)
        out = {}
        for path, names in by_file.items():  # one shard open at a time
            with open(path, "rb", buffering=0) as f:
                header, data_start = safetensors_header(f, path)
                for name in names:
                    entry = header[name]
                    begin, end = entry["data_offsets"]
                    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                    if dtype is None:
                        raise TypeError(f"{name} in {path} is stored as {entry['dtype']}, which lazy loading does not read")
                    tensor = torch.empty(entry["shape"], dtype=dtype)
                    if tensor.nbytes != end - begin:
                        raise ValueError(f"{name} in {path}: {end - begin} bytes for shape {entry['shape']} {entry['dtype']}")
                    f.seek(data_start + begin)
                    _read_exactly(f, tensor.reshape(-1).view(torch.uint8).numpy(), name, path)
                    out[name] = tensor
        return out


# safetensors' names of the dtypes a model checkpoint holds (the format is little-endian, as torch is on x86 / ARM)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def safetensors_header(f, path) -> Tuple[Dict[str, Any], int]:
    """The open file's tensor entries and where their data starts: 8 bytes of header size, the JSON header, the
    data, which must cover the tensors' offsets exactly. A file cut short (an interrupted download or copy) or
    otherwise damaged is named here, before any model is built from it: safetensors' own message names no file."""
    total = os.fstat(f.fileno()).st_size

    def corrupt(what: str) -> ValueError:
        return ValueError(f"{path} is truncated or corrupt ({what}); download or save it again")

    if total < 8:
        raise corrupt(f"{total} bytes, fewer than the 8 of a safetensors header's size")
    size = int.from_bytes(f.read(8), "little")
    if size > total - 8:
        raise corrupt(f"its header claims {size} bytes and the file holds {total - 8} after the size")
    try:
        header = json.loads(f.read(size))
    except ValueError as error:
        raise corrupt(f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise corrupt("a tensor entry of its header has no data offsets") from None
    if end != total - 8 - size:
        raise corrupt(f"its header describes {end} bytes of tensor data and the file holds {total - 8 - size}")
    return header, 8 + size


def _read_exactly(f, buffer, name: str, path: Path) -> None:
    view, done = memoryview(buffer), 0
    while done < len(view):  # a single read returns at most about 2 GiB on Linux
        count = f.readinto(view[done:])
        if not count:
            raise EOFError(f"{path} ends inside {name}")
        done += count


class _Source:
    """What a lazy module needs to find its tensors: the checkpoint, its name prefix, and the names under which
    the checkpoint may hold a tied parameter (``lm_head.weight`` saved as ``model.embed_tokens.weight``)."""

    def __init__(self, tensors: CheckpointTensors, prefix: str, aliases: Mapping[str, List[str]], dtype):
        self.tensors, self.prefix, self.aliases, self.dtype = tensors, prefix, aliases, dtype

    def key(self, name: str) -> str:
        full = f"{self.prefix}.{name}" if self.prefix else name
        for candidate in (full, *self.aliases.get(full, ())):
            if candidate in self.tensors:
                return candidate
        raise KeyError(f"{full} is not in the checkpoint {self.tensors.folder}")


def is_lazy(module: nn.Module) -> bool:
    return getattr(module, "_featcal_source", None) is not None


def _meta_parameters(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.is_meta]


def materialize(module: nn.Module, device) -> None:
    """Read a lazy module's parameters from its checkpoint onto ``device`` (in the model's dtype)."""
    from accelerate.utils import set_module_tensor_to_device

    source: _Source = module._featcal_source
    names = [name for name, _ in _meta_parameters(module)]
    keys = {name: source.key(name) for name in names}
    values = source.tensors.read(set(keys.values()))
    uses = Counter(keys.values())
    for name in names:
        # read into torch's own (64-byte aligned) allocations: on a tensor starting anywhere in a mapped file MKL may
        # take another kernel, and the lazy path then differed from the eager one in the last bits (AVX2 AMD EPYC)
        key = keys[name]
        uses[key] -= 1
        # let go of the read tensor at its last use, so that a dtype-converted copy does not sit beside it
        value = (values[key] if uses[key] else values.pop(key)).to(source.dtype)
        # checked a slice at a time: a whole-tensor mask of an embedding is another quarter of its float32 bytes
        if not all(bool(torch.isfinite(part).all()) for part in value.reshape(-1).split(1 << 24)):
            raise ValueError(non_finite_message(source.tensors, keys[name]))
        set_module_tensor_to_device(module, name, device, value=value)
    # buffers (small; rotary tables) follow the module onto the device and stay there
    for name, buffer in module.named_buffers():
        set_module_tensor_to_device(module, name, device, value=buffer)


def non_finite_message(tensors, key: str) -> str:
    """What to say of a tensor read with a NaN or an infinity: a merge computed as it is read (``lazy_merge``) names
    the input checkpoint(s) that hold them, or says that the merge itself overflowed."""
    message = f"{key} in {tensors.folder} has non-finite values"
    inputs = getattr(tensors, "non_finite_inputs", None)
    if inputs is None:
        return message
    culprits = inputs(key)
    if not culprits:
        return f"{message}: every input's {key} is finite, so the merge overflowed in its dtype"
    return f"{message}, from {' and '.join(culprits)}"


def release(module: nn.Module) -> None:
    """Put a lazy module's parameters back on the meta device (its memory is freed)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in list(module.named_parameters()):
        set_module_tensor_to_device(module, name, "meta")


def load_lazily(model_class, folder, torch_dtype: Optional[Any] = None) -> nn.Module:
    """``model_class`` (a model class or a transformers Auto class) built from the checkpoint folder's config with
    no weights read: every module reads its own tensors when a residency scope asks for them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    dtype = _dtype(torch_dtype)
    tensors = CheckpointTensors(folder)
    auto = model_class.__name__.startswith("Auto")
    # a class's own config class reads its part of a larger config (CLIPVisionConfig from a CLIP checkpoint)
    config = (AutoConfig if auto else model_class.config_class).from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        build = model_class.from_config if auto else model_class._from_config
        model = build(config, torch_dtype=dtype)
    model.eval()
    attach_tensors(model, tensors, dtype)
    return model


def lazy_like(reference: nn.Module, tensors) -> nn.Module:
    """A lazy model with the lazy ``reference``'s skeleton, config and dtype, its tensors read from ``tensors`` (as
    ``attach_tensors`` takes them): a merge of the reference's architecture, built from the reference's config
    whatever the merge's config.json says (a config written by transformers 5 keeps ``rope_theta`` where 4.x does
    not look)."""
    import copy

    model = copy.deepcopy(reference)  # meta parameters: the copy costs the buffers only
    attach_tensors(model, tensors, tensors_of(reference)[1])
    return model


def attach_tensors(model: nn.Module, tensors, dtype: torch.dtype) -> None:
    """Make every module of the skeleton ``model`` read its parameters from ``tensors`` (a ``CheckpointTensors``, or
    anything with its ``folder``, ``in`` and ``read``, e.g. a merge computed tensor by tensor) in ``dtype``."""
    aliases = tied_names(model)
    for prefix, module in model.named_modules():
        module._featcal_source = _Source(tensors, prefix, aliases, dtype)


def tensors_of(model: nn.Module):
    """The lazy ``model``'s tensors (what ``attach_tensors`` was given) and the dtype it reads them in."""
    source: _Source = model._featcal_source
    return source.tensors, source.dtype


def tied_names(model: nn.Module) -> Dict[str, List[str]]:
    """A parameter name -> the other names of the same tensor, one of which a checkpoint may hold instead."""
    names_of = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of[id(parameter)].append(name)
    aliases = {name: [n for n in names if n != name] for names in names_of.values() for name in names}
    # tied input / output embeddings that an empty skeleton did not tie: the checkpoint holds the input's
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        module_names = {id(m): n for n, m in model.named_modules()}
        output, input_ = (module_names[id(m)] for m in (model.get_output_embeddings(), model.get_input_embeddings()))
        aliases.setdefault(f"{output}.weight", []).append(f"{input_}.weight")
    return aliases


# The class each FusionBench pool loads a plain path with (CLIP's pool loads the vision tower of a full CLIP).
POOL_MODEL_CLASSES = {
    "CLIPVisionModelPool": "CLIPVisionModel",
    "CausalLMPool": "AutoModelForCausalLM",
    "Seq2SeqLMPool": "AutoModelForSeq2SeqLM",
}


def load_pool_model_lazily(modelpool, name: str) -> nn.Module:
    """The pool's model ``name`` as a lazy model: its entry's path (a string, or a config with
    ``pretrained_model_name_or_path``), its class (the entry's ``_target_``, else the pool's), its dtype (the
    entry's or the pool's ``model_kwargs.torch_dtype``). A pool entry that is a live module is refused by name."""
    import transformers
    from omegaconf import DictConfig, OmegaConf

    entry = modelpool.get_model_config(name, return_copy=False)
    if isinstance(entry, nn.Module):
        raise TypeError(f"lazy loading reads checkpoints; the pool's {name!r} is a live module (set models_in_memory=all)")
    raw = getattr(modelpool, "model_kwargs", None) or {}
    kwargs = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
    class_name = next((c for p, c in POOL_MODEL_CLASSES.items() if any(t.__name__ == p for t in type(modelpool).__mro__)), None)
    path = entry_path(entry)
    if isinstance(entry, (Mapping, DictConfig)):
        entry = OmegaConf.to_container(entry, resolve=True) if isinstance(entry, DictConfig) else dict(entry)
        target = entry.get("_target_", "")
        class_name = target.removesuffix(".from_pretrained").rsplit(".", 1)[-1] or class_name
        kwargs.update({k: v for k, v in entry.items() if k == "torch_dtype"})
    if not path or class_name is None or not hasattr(transformers, class_name):
        raise TypeError(f"lazy loading cannot tell the checkpoint and class of the pool's {name!r} ({entry!r})")
    return load_lazily(getattr(transformers, class_name), checkpoint_folder(str(path)), kwargs.get("torch_dtype"))


def entry_path(entry: Any) -> Optional[str]:
    """The checkpoint a pool entry names: the entry itself (a path or hub id), or its config's
    ``pretrained_model_name_or_path``; None for a live module or a config without one."""
    from omegaconf import DictConfig

    if isinstance(entry, (str, os.PathLike)):
        return str(entry)
    if isinstance(entry, (Mapping, DictConfig)):
        path = entry.get("pretrained_model_name_or_path")
        return None if path is None else str(path)
    return None


def _dtype(torch_dtype) -> torch.dtype:
    if torch_dtype is None or torch_dtype == "auto":
        return torch.float32  # what from_pretrained gives without torch_dtype (transformers 4.x)
    return getattr(torch, torch_dtype) if isinstance(torch_dtype, str) else torch_dtype


def checkpoint_folder(name_or_path: str) -> Path:
    """A local folder as it is; a hub id downloaded (its config and safetensors only)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))


__all__ = ["CheckpointTensors", "attach_tensors", "checkpoint_folder", "entry_path", "is_lazy", "lazy_like",
           "load_lazily", "load_pool_model_lazily", "materialize", "release", "safetensors_header", "tensors_of",
           "tied_names"]
