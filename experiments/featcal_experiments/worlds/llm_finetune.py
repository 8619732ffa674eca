"""Supervised fine-tuning of an LLM-world expert: every weight of the decoder layers, on the answer tokens of
prompt / response pairs rendered through the chat template, with bf16 autocast on CPUs that run bf16 faster than
float32 (``autocast_dtype``).

The tied input/output embedding and the final norm stay the base's. The embedding is 28 M of the model's 134.5 M
weights and, tied, is also ``lm_head``: FeatCal calibrates decoder blocks only, Surgery's maps act on ``lm_head``'s
input, and MergeBench and FusionBench's ``merge_backbone`` leave embeddings out of task vectors, so an expert that
differs from the base only in ``model.layers`` makes Task Arithmetic over the decoder layers the same as over the
whole model. Freezing it also doubles training speed on CPU (129 against 61 tokens/s in float32).
"""

from __future__ import annotations

import math
import random
import time
from functools import lru_cache
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from featcal_fusionbench.families.causal_lm import collate, tokenize_prompt_response


@lru_cache(maxsize=1)
def autocast_dtype() -> Optional[torch.dtype]:
    """bfloat16 where this CPU runs a training step of a linear layer at the world's width faster in bf16 autocast
    than in float32 (AVX-512 BF16 / AMX), else None (float32). Without native bf16, oneDNN's bf16 path is far slower:
    10x on a linear step of a 2-core AVX2 AMD EPYC, where an expert's step went from seconds to six minutes."""
    layer = torch.nn.Linear(576, 1536)
    inputs = torch.randn(256, 576, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def seconds(enabled: bool) -> float:
        best = math.inf
        for _ in range(4):  # the first is warm-up; the best of the rest
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                out = layer(inputs)
            out.float().sum().backward()
            best = min(best, time.perf_counter() - start)
        return best

    return torch.bfloat16 if seconds(True) < 0.8 * seconds(False) else None


def trainable_parameters(model) -> List[torch.nn.Parameter]:
    """Only ``model.layers`` trains (see the module's docstring)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("model.layers."))
    return [p for p in model.parameters() if p.requires_grad]


def finetune(model, tokenizer, rows: List[Dict], steps: int, batch_size: int, lr: float, seed: int,
             max_length: int = 256, desc: str = "fine-tuning") -> Dict[str, float]:
    """AdamW (master weights and moments in float32) under bf16 autocast where it is faster (``autocast_dtype``),
    linear warm-up over the first tenth then cosine decay; batches drawn without replacement, epoch after epoch, in
    a seeded order. The loss counts response tokens only (the answer and the closing ``<|im_end|>``). Returns the
    first and last losses, the tokens, the seconds and the autocast dtype."""
    encoded = [tokenize_prompt_response(tokenizer, r["prompt"], r["response"], max_length) for r in rows]
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    dtype = autocast_dtype()
    order_rng = random.Random(seed)
    order: List[int] = []
    losses, tokens = [], 0
    model.train()
    bar = tqdm(range(steps), desc=desc, mininterval=5)
    for _ in bar:
        if len(order) < batch_size:
            fresh = list(range(len(encoded)))
            order_rng.shuffle(fresh)
            order += fresh
        batch = collate([encoded[i] for i in order[:batch_size]], tokenizer.pad_token_id)
        del order[:batch_size]
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        target = batch["input_ids"][:, 1:].masked_fill(batch["response_mask"][:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10):]
    return {"loss_first": sum(head) / len(head), "loss_last": sum(tail) / len(tail), "tokens": tokens,
            "seconds": bar.format_dict["elapsed"], "autocast": str(dtype or torch.float32).replace("torch.", "")}
