"""HF ``T5ForConditionalGeneration`` (FLAN-T5): all encoder blocks, then all decoder blocks.

The walk reproduces ``T5Stack.forward`` one block at a time:
- encoder: token embeddings, then each block with the relative position bias of the model's first
  encoder block plus the padding mask (T5 computes it once and shares it across blocks);
- entering the decoder: the stream's own encoder output (after ``encoder.final_layer_norm``) becomes the
  cross-attention memory, so the calibrated model attends to its calibrated encoder and each expert to
  its own; the decoder input is the target labels shifted right (teacher forcing, the inputs the expert
  saw in fine-tuning), with the causal mask and the first decoder block's relative position bias.
Padding never enters a moment: encoder-side tokens are weighted by the input attention mask, decoder-side
tokens by ``labels != -100``, and the cross-attention k/v (whose inputs are encoder tokens) by the
encoder mask. ``final_layer_norm`` of both stacks and the embeddings keep their merged values.

Surgery's and ProbSurgery's maps act on the decoder's final hidden state entering ``lm_head``, per target
token under teacher forcing: the representation the output head reads, as CLIP's image feature is (an
encoder-side map would reach the output only through cross-attention). At generation the map applies to
every decoded position (``LMHeadSurgery``), with the task chosen by the task pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Hashable, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn
from transformers import T5ForConditionalGeneration, default_data_collator
from transformers.models.t5.modeling_t5 import T5LayerNorm

from ..models.task_switch import LMHeadSurgery
from . import register_family
from .base import FeatureSite, ModelFamily, OutputSite, batch_loader
from .sites import LinearSite, RMSNormSite

COLUMNS = ("input_ids", "attention_mask", "labels")
IGNORE_INDEX = -100  # label padding in FusionBench's FLAN-T5 data (and HF's convention)
STREAM_TOKENS = "stream-tokens"  # the tokens of the stack the block belongs to
ENCODER_TOKENS = "encoder-tokens"  # cross-attention keys/values read encoder tokens
_CROSS_KV = ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")
#: FusionBench scores FLAN-T5 text as ``model.generate(batch["input_ids"], max_length=10)`` decoded
#: (fusion_bench/tasks/flan_t5_text_generation/glue_evaluation.py: evaluate_accuracy, evaluate_spearman_rho)
GENERATION_MAX_LENGTH = 10


@dataclass(frozen=True)
class T5StreamState:
    """Per-batch metadata of one stream; replaced (never mutated) when the stream enters the decoder,
    because streams may share it (the upstream stream starts as a copy of the calibrated one)."""

    encoder_mask: Tensor  # (B, S) 1 for real input tokens
    labels: Tensor  # (B, T) with IGNORE_INDEX padding
    self_bias: Tensor  # relative position bias + mask of the current stack's self-attention
    decoder: bool = False
    encoder_hidden: Optional[Tensor] = None
    cross_bias: Optional[Tensor] = None

    @property
    def token_mask(self) -> Tensor:
        return (self.labels != IGNORE_INDEX) if self.decoder else self.encoder_mask.bool()


def _mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive key mask (B, 1, 1, S) as ``T5Stack`` builds it."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _relative_bias(stack: nn.Module, query_length: int, key_length: int) -> Tensor:
    attention = stack.block[0].layer[0].SelfAttention
    return attention.compute_bias(query_length, key_length)


class T5DecoderFeatureSite(FeatureSite):
    """The decoder's final hidden state at every target token (teacher forcing on the labels)."""

    one_row_per_example = False

    def __init__(self, model: T5ForConditionalGeneration):
        self.dim = model.config.d_model

    def features(self, model: nn.Module, batch: dict) -> Tensor:
        captured = []
        handle = model.lm_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            # Teacher forcing without the loss: the decoder reads the shifted labels, as the expert did in training.
            model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                decoder_input_ids=model._shift_right(batch["labels"]),
            )
        finally:
            handle.remove()
        return captured[-1][batch["labels"] != IGNORE_INDEX]

    def deploy(self, wrapper: nn.Module) -> nn.Module:
        return LMHeadSurgery(wrapper)


class T5GreedyOutput(OutputSite):
    """The greedy generation FusionBench's text task pool scores (``GENERATION_MAX_LENGTH``; greedy stated, so
    that a checkpoint's sampling config cannot make the choice random), and an expert's teacher-forced probability
    of it: its tokens up to and with the first end-of-sequence token, the decoder's start token left out."""

    def __init__(self, tokenizer=None, max_length: int = GENERATION_MAX_LENGTH):
        self.tokenizer = tokenizer
        self.max_length = max_length

    @torch.no_grad()
    def generate(self, model, batch):
        return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              max_length=self.max_length, do_sample=False, num_beams=1)

    @torch.no_grad()
    def probability(self, expert, batch, outputs):
        labels = outputs[:, 1:].clone()  # generate's first token is the decoder's start token
        end = labels == expert.config.eos_token_id
        labels[(end.long().cumsum(-1) - end.long()) > 0] = IGNORE_INDEX  # what follows the first end is padding
        logits = expert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=expert._shift_right(labels)).logits
        logp = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return logp.masked_fill(labels == IGNORE_INDEX, 0.0).sum(-1).exp()


@register_family
class T5Family(ModelFamily):
    """Encoder blocks then decoder blocks of a ``T5ForConditionalGeneration``; linears and, when enabled,
    the scale-only ``T5LayerNorm`` (RMSNorm) of every block."""

    name = "t5"

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return isinstance(model, T5ForConditionalGeneration)

    def sites(self, block):
        found = {}
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                found[name] = LinearSite(module)
            elif isinstance(module, T5LayerNorm):
                found[name] = RMSNormSite(module)
        return found

    def blocks(self, model):
        return list(model.encoder.block) + list(model.decoder.block)

    def stem_modules(self, model):
        stacks = (model.encoder, model.decoder)
        modules = [stack.embed_tokens for stack in stacks] + [model.encoder.final_layer_norm]
        return modules + [stack.block[0].layer[0].SelfAttention.relative_attention_bias for stack in stacks]

    def embed(self, model, inputs: Dict[str, Tensor]) -> Tuple[Tensor, T5StreamState]:
        encoder = model.encoder
        hidden = encoder.embed_tokens(inputs["input_ids"])
        length = hidden.shape[1]
        bias = _relative_bias(encoder, length, length).to(hidden.dtype) + _mask_bias(inputs["attention_mask"], hidden.dtype)
        return hidden, T5StreamState(inputs["attention_mask"], inputs["labels"], bias)

    def enter_block(self, model, index, hidden, meta: T5StreamState):
        if index != len(model.encoder.block):
            return hidden, meta
        decoder = model.decoder
        encoder_hidden = model.encoder.final_layer_norm(hidden)
        decoder_ids = model._shift_right(meta.labels)  # start token, then labels; -100 becomes pad
        decoder_hidden = decoder.embed_tokens(decoder_ids)
        dtype, length = decoder_hidden.dtype, decoder_ids.shape[1]
        # Labels are right-padded, so the causal mask alone keeps padding out of every real token's context.
        causal = torch.full((length, length), torch.finfo(dtype).min, device=hidden.device).triu(1)
        self_bias = _relative_bias(decoder, length, length).to(dtype) + causal[None, None]
        cross_bias = _mask_bias(meta.encoder_mask, dtype).expand(-1, decoder.config.num_heads, length, -1)
        state = replace(meta, self_bias=self_bias, decoder=True, encoder_hidden=encoder_hidden, cross_bias=cross_bias)
        return decoder_hidden, state

    def run_block(self, block, hidden, meta: T5StreamState):
        if not meta.decoder:
            return block(hidden, position_bias=meta.self_bias, use_cache=False)[0]
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        return block(
            hidden,
            position_bias=meta.self_bias,
            encoder_hidden_states=meta.encoder_hidden,
            encoder_decoder_position_bias=meta.cross_bias,
            use_cache=False,
            cache_position=positions,
        )[0]

    def head_modules(self, model):
        return [model.decoder.final_layer_norm, model.lm_head]

    def predict(self, model, hidden, meta):
        """Decoder-token logits from the last decoder block's output, as ``T5ForConditionalGeneration`` computes
        them (scaled by d_model ** -0.5 when the head is tied to the embeddings)."""
        hidden = model.decoder.final_layer_norm(hidden)
        if model.config.tie_word_embeddings:
            hidden = hidden * model.model_dim**-0.5
        return model.lm_head(hidden)

    def weight_profile(self, block_index: int, num_blocks: int, module_name: str) -> Hashable:
        return ENCODER_TOKENS if module_name in _CROSS_KV else STREAM_TOKENS

    def token_weights(self, profile, hidden, meta: T5StreamState, dtype) -> Optional[Tensor]:
        mask = meta.encoder_mask if profile == ENCODER_TOKENS else meta.token_mask
        return mask.to(dtype)

    def valid_token_mask(self, meta: T5StreamState, hidden: Tensor) -> Optional[Tensor]:
        return meta.token_mask

    def batches(self, modelpool, dataset, batch_size, shuffle=False, seed=0) -> Iterator[Dict[str, Tensor]]:
        loader = batch_loader(teacher_forcing_columns(dataset), batch_size, shuffle, seed, default_data_collator)
        return (trim_padding(batch) for batch in loader)

    def output_site(self, tokenizer=None):
        return T5GreedyOutput(tokenizer)

    def feature_site(self, modelpool, model):
        return T5DecoderFeatureSite(model)


def teacher_forcing_columns(dataset):
    """The dataset restricted to the columns a teacher-forced forward reads; an error names any that is missing."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return dataset
    if not set(COLUMNS) <= set(columns):
        raise ValueError(
            f"T5 calibration examples need {list(COLUMNS)} (teacher forcing on the targets); the dataset has {columns}"
        )
    return dataset.select_columns(list(COLUMNS))


def trim_padding(batch: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Cut the columns that are padding in every row (FusionBench pads GLUE to 512 tokens).

    Exact for right-padded batches: padded keys are masked out of every real token's attention.
    """
    encoder_mask = batch["attention_mask"]
    labels = batch["labels"]
    source = int(encoder_mask.any(dim=0).nonzero().max()) + 1 if encoder_mask.any() else 1
    target_valid = (labels != IGNORE_INDEX).any(dim=0)
    if not target_valid.any():
        raise ValueError("a calibration batch has no target tokens (all labels are -100)")
    target = int(target_valid.nonzero().max()) + 1
    return {
        "input_ids": batch["input_ids"][:, :source],
        "attention_mask": encoder_mask[:, :source],
        "labels": labels[:, :target],
    }
