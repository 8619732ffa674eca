"""HF CLIP vision towers as open_clip ``VisionTransformer``s with the same weights, and back; and the HF CLIP
tokenizer's files from the BPE vocabulary that ships inside open_clip's wheel.

The two libraries hold the same network under other names: HF's q/k/v projections are the three row blocks of
open_clip's fused ``in_proj_weight``; ``fc1``/``fc2`` are ``c_fc``/``c_proj``; ``layer_norm1/2`` are ``ln_1/ln_2``;
``pre_layrnorm``/``post_layernorm`` are ``ln_pre``/``ln_post``; HF's ``visual_projection`` is ``proj`` transposed.
This is what the exactness tests between the ``clip_vision`` and ``openclip_vision`` families stand on, and how the
experiments serve an HF-trained world through OpenCLIP pools.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Dict, Optional

import torch
from open_clip.tokenizer import bytes_to_unicode
from open_clip.transformer import QuickGELU, VisionTransformer
from torch import Tensor, nn
from transformers import CLIPVisionModel

ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}


def _block_map(i: int) -> Dict[str, str]:
    """open_clip block parameter -> HF layer parameter (q/k/v handled apart: fused)."""
    hf, oc = f"vision_model.encoder.layers.{i}.", f"transformer.resblocks.{i}."
    pairs = {
        "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
        "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
        "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
        "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
        "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
    }
    return {oc + o: hf + h for o, h in pairs.items()}


STEM = {
    "conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "class_embedding": "vision_model.embeddings.class_embedding",
    "positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "ln_pre.weight": "vision_model.pre_layrnorm.weight", "ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "ln_post.weight": "vision_model.post_layernorm.weight", "ln_post.bias": "vision_model.post_layernorm.bias",
}


def parameter_map(layers: int) -> Dict[str, str]:
    """Every one-to-one open_clip tower key -> HF ``CLIPVisionModel`` key (not the fused q/k/v, not ``proj``)."""
    out = dict(STEM)
    for i in range(layers):
        out.update(_block_map(i))
    return out


def _qkv(prefix: str, kind: str) -> list:
    return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]


def hf_to_openclip(hf: CLIPVisionModel, projection: Optional[Tensor] = None) -> VisionTransformer:
    """An open_clip tower computing what ``hf`` computes; ``projection`` (out, hidden: HF's ``visual_projection``
    weight) becomes ``proj``, or ``proj`` is None (the pooled, ``ln_post``-normalised CLS token)."""
    cfg = hf.config
    if cfg.hidden_act not in ACTIVATIONS:
        raise ValueError(f"no open_clip activation for HF hidden_act {cfg.hidden_act!r}; known: {sorted(ACTIVATIONS)}")
    if cfg.layer_norm_eps != 1e-5:
        raise ValueError(f"open_clip's LayerNorm uses eps 1e-5; the HF model has {cfg.layer_norm_eps}")
    tower = VisionTransformer(
        image_size=cfg.image_size, patch_size=cfg.patch_size, width=cfg.hidden_size, layers=cfg.num_hidden_layers,
        heads=cfg.num_attention_heads, mlp_ratio=cfg.intermediate_size / cfg.hidden_size,
        output_dim=projection.shape[0] if projection is not None else cfg.hidden_size,
        act_layer=ACTIVATIONS[cfg.hidden_act],
    )
    source = hf.state_dict()
    state = {oc: source[h] for oc, h in parameter_map(cfg.num_hidden_layers).items()}
    for i in range(cfg.num_hidden_layers):
        prefix = f"vision_model.encoder.layers.{i}."
        state[f"transformer.resblocks.{i}.attn.in_proj_weight"] = torch.cat([source[k] for k in _qkv(prefix, "weight")])
        state[f"transformer.resblocks.{i}.attn.in_proj_bias"] = torch.cat([source[k] for k in _qkv(prefix, "bias")])
    if projection is None:
        tower.proj = None
    else:
        state["proj"] = projection.t().contiguous()
    tower.load_state_dict(state, strict=True)
    return tower.to(hf.dtype).eval()


def openclip_to_hf_state(tower: VisionTransformer) -> Dict[str, Tensor]:
    """The HF ``CLIPVisionModel`` state dict holding ``tower``'s weights (the projection is not part of it)."""
    source = tower.state_dict()
    layers = len(tower.transformer.resblocks)
    state = {h: source[oc] for oc, h in parameter_map(layers).items()}
    for i in range(layers):
        prefix = f"vision_model.encoder.layers.{i}."
        for kind, fused in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            for key, rows in zip(_qkv(prefix, kind), source[f"transformer.resblocks.{i}.attn.{fused}"].chunk(3)):
                state[key] = rows
    return state


# Same cut as CLIP's and open_clip's tokenizers: 49,152 - 256 - 2 merges, then the
# byte alphabet, its '</w>' forms, the merges, and the two special tokens = 49,408 ids.
_NUM_MERGES = 49152 - 256 - 2
START, END = "<|startoftext|>", "<|endoftext|>"


def write_clip_tokenizer_files(directory: Path) -> tuple[Path, Path]:
    """Write vocab.json and merges.txt for transformers' (slow) ``CLIPTokenizer``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = resources.files("open_clip").joinpath("bpe_simple_vocab_16e6.txt.gz").read_bytes()
    lines = gzip.decompress(bpe).decode("utf-8").split("\n")[1 : _NUM_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += [START, END]
    vocab_path = directory / "vocab.json"
    merges_path = directory / "merges.txt"
    vocab_path.write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    merges_path.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return vocab_path, merges_path


def clip_tokenizer(directory: Path):
    """A slow ``CLIPTokenizer`` (the fast one does not match open_clip's ids)."""
    from transformers import CLIPTokenizer

    vocab_path, merges_path = write_clip_tokenizer_files(directory)
    return CLIPTokenizer(str(vocab_path), str(merges_path))
