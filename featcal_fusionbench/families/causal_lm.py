"""HF decoder-only causal LMs: Llama, Mistral, Qwen2 and Gemma-2 (``*ForCausalLM`` and the bare ``*Model``).

The walk reproduces the decoder's forward one layer at a time, for the positions ``generate`` uses:
- token embeddings (Gemma-2: times sqrt(hidden_size), rounded to the model's dtype as Gemma-2 does);
- position ids from the attention mask (``cumsum - 1``, padding at 1: HF's rule in ``generate``), so a
  left-padded and a right-padded row give their real tokens the same states as the row alone;
- the rotary embeddings, computed once per batch by the model's own ``rotary_emb``, and the 4-D
  causal + padding masks built by ``transformers.masking_utils`` exactly as the model's forward builds
  them: one per attention kind (Gemma-2 and Qwen2 alternate full and sliding-window layers; Mistral
  uses a sliding-window mask in every layer when its config has a window). Both follow the model's dtype.
The walk ends at the last layer's output, before the final norm: ``model.norm``, the embeddings and
``lm_head`` keep the merged model's values.

Sites per layer, in forward order: ``input_layernorm``, ``self_attn.{q,k,v}_proj`` (one shared input;
Qwen2's q/k/v biases are calibrated when ``calibrate_bias``), ``self_attn.o_proj``,
``post_attention_layernorm``, (Gemma-2: ``pre_feedforward_layernorm``), ``mlp.{gate,up}_proj`` (shared
input), ``mlp.down_proj``, (Gemma-2: ``post_feedforward_layernorm``). The RMSNorm scales are solved
like a LayerNorm affine without a shift. Gemma-2's RMSNorm multiplies by ``1 + weight``: it is handled
exactly (``OffsetRMSNormSite``): the solver sees the effective scale ``s = 1 + weight`` and writes back
``weight = s - 1``.

Surgery's and ProbSurgery's maps act on the last hidden state entering ``lm_head`` (after the final
norm) at every counted position, and are deployed on ``lm_head``'s input (``LMHeadSurgery``), as for T5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from transformers import (
    Gemma2ForCausalLM,
    Gemma2Model,
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    MistralModel,
    Qwen2ForCausalLM,
    Qwen2Model,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

from ..models.task_switch import LMHeadSurgery
from . import register_family
from .base import FeatureSite, ModelFamily, batch_loader
from .sites import LinearSite, RMSNormSite, Site

CAUSAL_LM_CLASSES = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Gemma2ForCausalLM)
BARE_CLASSES = (LlamaModel, MistralModel, Qwen2Model, Gemma2Model)
GEMMA_CLASSES = (Gemma2ForCausalLM, Gemma2Model)

FULL, SLIDING = "full_attention", "sliding_attention"
MASK_BUILDERS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
COUNTED_TOKENS = "counted-tokens"  # the one token-weight profile: non-padding (or response) tokens
RESPONSE_ONLY = "response_only"
MAX_LENGTH = "max_length"
TEXT_FORMAT = "text_format"
CHAT_TEMPLATE, ALPACA = "chat_template", "alpaca"
TEXT_FORMATS = (CHAT_TEMPLATE, ALPACA)
# Stanford Alpaca's prompt without an input (tatsu-lab/stanford_alpaca, train.py PROMPT_DICT["prompt_no_input"]); an
# Alpaca `input` arrives joined to the instruction (text_data.prompt_response)
ALPACA_TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class OffsetRMSNormSite(RMSNormSite):
    """Gemma's RMSNorm, ``normalize(x) * (1 + weight)``: the site's scale is ``1 + weight``.

    The scale is read in float64 so that writing a read value back restores the stored weight bit for bit
    (``(w + 1) - 1`` is exact there for every float32/bf16/fp16 weight not far below 2**-29 in magnitude).
    """

    @property
    def weight(self) -> Tensor:
        return self.module.weight.detach().double() + 1.0

    def write(self, weight=None, bias=None):
        if bias is not None:
            raise ValueError("Gemma's RMSNorm has no shift to write")
        if weight is not None:
            super().write(weight=weight.double() - 1.0)


@dataclass(frozen=True)
class CausalLMState:
    """Per-batch metadata of one stream (shared by streams: never mutated)."""

    attention_mask: Tensor  # (B, S) 1 for real tokens
    token_mask: Tensor  # (B, S) bool: the tokens whose moments count
    position_ids: Tensor  # (B, S)
    cache_position: Tensor  # (S,)
    position_embeddings: Tuple[Tensor, Tensor]  # rotary (cos, sin), in the model's dtype
    masks: Dict[str, Optional[Tensor]]  # attention kind -> the 4-D mask (None where the model lets SDPA be causal)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """HF's positions for padded batches (``GenerationMixin``): count real tokens; padding gets 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def decoder_of(model: nn.Module) -> nn.Module:
    return model if isinstance(model, BARE_CLASSES) else model.model


def attention_kind(layer: nn.Module) -> str:
    """Which of the model's masks a layer reads, as the model's forward picks it."""
    kind = getattr(layer, "attention_type", None)  # Gemma-2, Qwen2: per layer from config.layer_types
    if kind is not None:
        return kind
    # Mistral's forward builds one sliding-window mask for every layer when the config has a window; Llama has none.
    if isinstance(layer, MistralDecoderLayer) and layer.self_attn.config.sliding_window is not None:
        return SLIDING
    return FULL


class CausalLMFeatureSite(FeatureSite):
    """The hidden state entering ``lm_head`` (after the final norm) at every counted token."""

    one_row_per_example = False

    def __init__(self, family: "CausalLMFamily", model: nn.Module):
        if isinstance(model, BARE_CLASSES):
            raise TypeError(
                f"Surgery and ProbSurgery act on lm_head's input; a bare {type(model).__name__} has no lm_head "
                "(load the *ForCausalLM model)"
            )
        self.family = family
        self.dim = model.config.hidden_size

    def features(self, model: nn.Module, batch: dict) -> Tensor:
        mask = batch.get("attention_mask")
        mask = torch.ones_like(batch["input_ids"]) if mask is None else mask
        # The decoder's last_hidden_state is exactly lm_head's input, without the vocabulary-sized logits.
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False,
        ).last_hidden_state
        return hidden[self.family.counted_tokens(batch, mask)]

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        return LMHeadSurgery(wrapper)


@register_family
class CausalLMFamily(ModelFamily):
    """Decoder layers of a Llama / Mistral / Qwen2 / Gemma-2 causal LM; see the module docstring.

    Options:
        response_only: count only response tokens in every moment (the batch's ``response_mask``, within
            the attention mask), e.g. the answers of instruction data; by default every non-padding token
            counts uniformly.
        max_length: tokens kept of an example given as ``prompt`` / ``response`` text (cut at the end).
        text_format: how ``prompt`` / ``response`` text is laid out: ``chat_template`` (the tokenizer's template, as
            the chat-template tasks of the evaluation prompt the model; plain text when it has none) or ``alpaca``
            (Stanford Alpaca's template: the family of formats MergeBench's merging code and its one published expert
            recipe, axolotl's ``gpteacher``, use; docs/families/causal_lm.md).
    """

    name = "causal_lm"
    options = {RESPONSE_ONLY: False, MAX_LENGTH: 1024, TEXT_FORMAT: CHAT_TEMPLATE}

    def check_option(self, name, value):
        if name == RESPONSE_ONLY and not isinstance(value, bool):
            return f"{RESPONSE_ONLY} must be true or false, got {value!r}"
        if name == MAX_LENGTH and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            return f"{MAX_LENGTH} must be an integer of at least 2, got {value!r}"
        if name == TEXT_FORMAT and value not in TEXT_FORMATS:
            return f"{TEXT_FORMAT} must be one of {TEXT_FORMATS}, got {value!r}"
        return None

    @property
    def response_only(self) -> bool:
        return self.option_values[RESPONSE_ONLY]

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return isinstance(model, CAUSAL_LM_CLASSES + BARE_CLASSES)

    @classmethod
    def shapes_may_differ(cls, model: nn.Module) -> Tuple[str, ...]:
        # MergeBench's Llama-3.2-3B experts have 64 more vocabulary rows than their base (FusionBench issue #215);
        # each model embeds its own tokens, and neither table is calibrated
        return tuple(k for k in model.state_dict() if k.endswith("embed_tokens.weight") or k == "lm_head.weight")

    # ---- the walk ---------------------------------------------------------------------------------

    def blocks(self, model):
        return list(decoder_of(model).layers)

    def stem_modules(self, model):
        decoder = decoder_of(model)
        return [decoder.embed_tokens, decoder.rotary_emb]

    def embed(self, model, inputs: Dict[str, Tensor]) -> Tuple[Tensor, CausalLMState]:
        decoder = decoder_of(model)
        input_ids = inputs["input_ids"]
        attention_mask = inputs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = decoder.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        position_ids = position_ids_from_mask(attention_mask)
        kinds = {attention_kind(layer) for layer in decoder.layers}
        masks = {
            kind: MASK_BUILDERS[kind](
                config=decoder.config, input_embeds=hidden, attention_mask=attention_mask,
                cache_position=cache_position, past_key_values=None, position_ids=position_ids,
            )
            for kind in sorted(kinds)
        }
        rotary = decoder.rotary_emb(hidden, position_ids)
        if isinstance(model, GEMMA_CLASSES):
            # After the rotary embeddings, with the normaliser rounded to the model's dtype, as Gemma-2 does.
            hidden = hidden * torch.tensor(decoder.config.hidden_size**0.5, dtype=hidden.dtype)
        state = CausalLMState(
            attention_mask, self.counted_tokens(inputs, attention_mask), position_ids, cache_position, rotary, masks,
        )
        return hidden, state

    def run_block(self, block, hidden, meta: CausalLMState):
        out = block(
            hidden,
            attention_mask=meta.masks[attention_kind(block)],
            position_ids=meta.position_ids,
            past_key_values=None,
            use_cache=False,
            cache_position=meta.cache_position,
            position_embeddings=meta.position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out  # Gemma-2's layer returns a tuple, the others a tensor

    # ---- sites and tokens -------------------------------------------------------------------------

    def sites(self, block) -> Dict[str, Site]:
        norm = OffsetRMSNormSite if isinstance(block.input_layernorm, Gemma2RMSNorm) else RMSNormSite
        gemma = hasattr(block, "pre_feedforward_layernorm")
        found: Dict[str, Site] = {"input_layernorm": norm(block.input_layernorm)}
        found.update({f"self_attn.{n}": LinearSite(getattr(block.self_attn, n)) for n in _ATTENTION})
        found["post_attention_layernorm"] = norm(block.post_attention_layernorm)
        if gemma:
            found["pre_feedforward_layernorm"] = norm(block.pre_feedforward_layernorm)
        found.update({f"mlp.{n}": LinearSite(getattr(block.mlp, n)) for n in _MLP})
        if gemma:
            found["post_feedforward_layernorm"] = norm(block.post_feedforward_layernorm)
        return found

    def head_modules(self, model):
        """The final norm and ``lm_head`` (a bare decoder without ``lm_head`` has no predictions)."""
        if getattr(model, "lm_head", None) is None:
            return None
        return [decoder_of(model).norm, model.lm_head]

    def predict(self, model, hidden, meta: CausalLMState):
        """Next-token logits, as the model's own forward computes them from the last layer's output (Gemma-2's
        final logit soft-capping left out: it is monotone, so the argmax is the same)."""
        return model.lm_head(decoder_of(model).norm(hidden))

    def weight_profile(self, block_index: int, num_blocks: int, site_name: str) -> Hashable:
        return COUNTED_TOKENS

    def token_weights(self, profile, hidden, meta: CausalLMState, dtype) -> Optional[Tensor]:
        return meta.token_mask.to(dtype)

    def valid_token_mask(self, meta: CausalLMState, hidden: Tensor) -> Optional[Tensor]:
        return meta.attention_mask.bool()

    def counted_tokens(self, inputs: Dict[str, Tensor], attention_mask: Tensor) -> Tensor:
        """Non-padding tokens, or with ``response_only`` the response tokens among them."""
        mask = attention_mask.bool()
        if not self.response_only:
            return mask
        if inputs.get("response_mask") is None:
            raise ValueError(
                f"family option {RESPONSE_ONLY}=true needs a 'response_mask' in every calibration batch "
                f"(1 on response tokens); this batch has {sorted(inputs)}"
            )
        return mask & inputs["response_mask"].bool()

    # ---- data ---------------------------------------------------------------------------------------

    def batches(self, modelpool, dataset, batch_size, shuffle=False, seed=0) -> Iterator[Dict[str, Tensor]]:
        columns = getattr(dataset, "column_names", None)
        text = columns is not None and {"prompt", "response"} <= set(columns) and "input_ids" not in columns
        if columns is not None and "input_ids" not in columns and not text:
            raise ValueError(
                "causal LM calibration examples need 'prompt' and 'response' text or pre-tokenized 'input_ids'; "
                f"the dataset has {columns}"
            )
        if self.response_only and columns is not None and not text and "response_mask" not in columns:
            raise ValueError(
                f"family option {RESPONSE_ONLY}=true needs a 'response_mask' column; the dataset has {columns}"
            )
        if text:
            tokenizer = load_tokenizer(modelpool)
            max_length = int(self.option_values[MAX_LENGTH])
            text_format = self.option_values[TEXT_FORMAT]

            def encode(rows):
                return [tokenize_prompt_response(tokenizer, r["prompt"], r["response"], max_length, text_format)
                        for r in rows]
        else:
            tokenizer, encode = None, list
        pad_id = pad_token_id(modelpool, tokenizer)
        return batch_loader(dataset, batch_size, shuffle, seed, lambda rows: collate(encode(rows), pad_id))

    def feature_site(self, modelpool, model):
        return CausalLMFeatureSite(self, model)


def has_tokenizer(modelpool) -> bool:
    """Whether the pool names a tokenizer (CausalLMPool's ``tokenizer`` config)."""
    return getattr(modelpool, "load_tokenizer", None) is not None and getattr(modelpool, "tokenizer", None) is not None


def load_tokenizer(modelpool):
    """The pool's tokenizer; text examples cannot be encoded without one."""
    if not has_tokenizer(modelpool):
        raise ValueError(
            "calibration examples given as 'prompt' / 'response' text need the model pool's tokenizer "
            f"(CausalLMPool's `tokenizer`); this {type(modelpool).__name__} has none"
        )
    return modelpool.load_tokenizer()


def pad_token_id(modelpool, tokenizer=None) -> int:
    """The pool's tokenizer's pad id, or 0 (padded positions are masked: the id only has to exist)."""
    if tokenizer is None:
        if not has_tokenizer(modelpool):
            return 0
        tokenizer = modelpool.load_tokenizer()
    pad = tokenizer.pad_token_id
    return 0 if pad is None else int(pad)


def tokenize_prompt_response(tokenizer, prompt: str, response: str, max_length: int,
                             text_format: str = CHAT_TEMPLATE) -> Dict[str, List[int]]:
    """One example as the model sees it in use: with the tokenizer's chat template (a user turn, then the assistant's
    answer) when it has one, else the prompt then the response and eos; ``alpaca``: the prompt in Alpaca's template,
    then the response and eos. ``response_mask`` marks the tokens after the prompt (with a template: after the
    generation prompt that opens the assistant's turn). Cut to ``max_length``."""
    if text_format == ALPACA:
        prompt = ALPACA_TEMPLATE.format(instruction=prompt)
    if text_format == CHAT_TEMPLATE and getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": prompt}]
        head = list(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True))
        full = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=True))
        if full[: len(head)] != head:
            raise ValueError("the tokenizer's chat template does not render a conversation's opening as its prefix; "
                             "give the examples as pre-tokenized input_ids / response_mask instead")
    else:
        head = tokenizer(prompt)["input_ids"]
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        full = head + tokenizer(response, add_special_tokens=False)["input_ids"] + eos
    full = full[:max_length]
    prompt_length = min(len(head), len(full))
    return {"input_ids": full, "attention_mask": [1] * len(full),
            "response_mask": [0] * prompt_length + [1] * (len(full) - prompt_length)}


def collate(rows: List[Dict[str, Any]], pad_id: int) -> Dict[str, Tensor]:
    """Right-pad ``input_ids`` (and ``attention_mask`` / ``response_mask`` where the rows have them).

    Columns that are padding in every row at the end are dropped: under causal attention no real token
    reads a later position, so this is exact.
    """
    ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
    length = max(len(x) for x in ids)
    batch = {"input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long)}
    for key in ("attention_mask", "response_mask"):
        if key == "attention_mask" or all(key in row for row in rows):
            batch[key] = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (row, x) in enumerate(zip(rows, ids)):
        batch["input_ids"][i, : len(x)] = x
        batch["attention_mask"][i, : len(x)] = torch.as_tensor(row.get("attention_mask", [1] * len(x)))
        if "response_mask" in batch:
            batch["response_mask"][i, : len(x)] = torch.as_tensor(row["response_mask"])
    real = batch["attention_mask"].any(dim=0).nonzero()
    keep = int(real.max()) + 1 if len(real) else length
    return {key: value[:, :keep] for key, value in batch.items()}
