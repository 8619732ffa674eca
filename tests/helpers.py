"""Tiny models and an independent FeatCal solve from raw features, for the tests."""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel


def tiny_clip_vision(seed: int = 0, layers: int = 3, hidden: int = 32) -> CLIPVisionModel:
    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        projection_dim=16,
    )
    return CLIPVisionModel(config).eval()


def perturbed(model, scale: float, seed: int):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return out


def task_arithmetic(base, experts, scale: float):
    merged = copy.deepcopy(base)
    base_state = base.state_dict()
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.copy_(base_state[name] + scale * sum(e.state_dict()[name] - base_state[name] for e in experts))
    return merged


def tiny_world(num_tasks: int = 2, seed: int = 0, batches: int = 3, batch_size: int = 4):
    base = tiny_clip_vision(seed)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    data = {t: [torch.randn(batch_size, 3, 16, 16, generator=g) for _ in range(batches)] for t in experts}
    return base, experts, merged, data


def recorded_inputs(block, names: List[str], forward) -> Dict[str, List[torch.Tensor]]:
    """Inputs of ``block``'s modules ``names``, one tensor per call, while ``forward()`` runs the whole model."""
    modules = dict(block.named_modules())
    collected = {n: [] for n in names}
    handles = [
        modules[n].register_forward_pre_hook(lambda _m, args, n=n: collected[n].append(args[0].detach()))
        for n in names
    ]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return collected


def block_module_inputs(model, block_index: int, names: List[str], batches) -> Dict[str, torch.Tensor]:
    """Inputs of a block's modules over all batches, from HF's own full forward (tokens flattened)."""
    block = model.vision_model.encoder.layers[block_index]
    collected = recorded_inputs(block, names, lambda: [model(pixel_values=x) for x in batches])
    return {n: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).double() for n, v in collected.items()}


def independent_linear_solve(x_cal, x_exp, w_exp, b_exp, w_anc, b_anc, lam, alpha, eps, token_weights=None):
    """Minimise Eq. 15 (then Eq. 53 with W* fixed) by stacked least squares over raw tokens."""
    rows_a, rows_b, omegas = [], [], []
    for i, (xc, xe) in enumerate(zip(x_cal, x_exp)):
        w = torch.ones(xc.shape[0], dtype=xc.dtype) if token_weights is None else token_weights[i]
        gram = (xc * w[:, None]).T @ xc / w.sum()
        omega = 1.0 / max(float(torch.linalg.matrix_norm(gram)), eps)
        omegas.append(omega)
        s = (omega * w / w.sum()).sqrt()[:, None]
        x_tgt = alpha * xe + (1 - alpha) * xc
        rows_a.append(s * xc)
        rows_b.append(s * (x_tgt @ w_exp[i].double().T))
    d = x_cal[0].shape[1]
    rows_a += [lam**0.5 * torch.eye(d, dtype=torch.float64), (eps) ** 0.5 * torch.eye(d, dtype=torch.float64)]
    rows_b += [lam**0.5 * w_anc.double().T, torch.zeros(d, w_anc.shape[0], dtype=torch.float64)]
    weight = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution.T
    if b_exp is None:
        return weight, None
    rows_a, rows_b = [], []
    for i, (xc, xe) in enumerate(zip(x_cal, x_exp)):
        w = torch.ones(xc.shape[0], dtype=xc.dtype) if token_weights is None else token_weights[i]
        s = (omegas[i] * w / w.sum()).sqrt()[:, None]
        x_tgt = alpha * xe + (1 - alpha) * xc
        residual = x_tgt @ w_exp[i].double().T + b_exp[i].double() - xc @ weight.T
        rows_a.append(s)
        rows_b.append(s * residual)
    rows_a.append(lam**0.5 * torch.ones(1, 1, dtype=torch.float64))
    rows_b.append(lam**0.5 * b_anc.double()[None, :])
    bias = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution[0]
    return weight, bias


def independent_layernorm_solve(x_cal, ln_eps, gammas, betas, g_anc, b_anc, lam):
    """Minimise Eq. 57 coordinate by coordinate by least squares over raw tokens."""
    d = x_cal[0].shape[1]
    zs = [F.layer_norm(x, (d,), eps=ln_eps) for x in x_cal]
    gamma, beta = torch.empty(d, dtype=torch.float64), torch.empty(d, dtype=torch.float64)
    for k in range(d):
        rows_a, rows_b = [], []
        for z, gi, bi in zip(zs, gammas, betas):
            s = (1.0 / z.shape[0]) ** 0.5
            rows_a.append(s * torch.stack([z[:, k], torch.ones_like(z[:, k])], 1))
            rows_b.append(s * (gi[k].double() * z[:, k] + bi[k].double())[:, None])
        rows_a.append(lam**0.5 * torch.eye(2, dtype=torch.float64))
        rows_b.append(lam**0.5 * torch.stack([g_anc[k], b_anc[k]]).double()[:, None])
        sol = torch.linalg.lstsq(torch.cat(rows_a), torch.cat(rows_b), driver="gelsd").solution[:, 0]
        gamma[k], beta[k] = sol
    return gamma, beta


# ---- tiny T5 (FLAN-T5's layout: gated-GELU, untied head, relative position bias) ------------------------


def tiny_t5(seed: int = 0, layers: int = 2, d_model: int = 32, vocab: int = 64):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab, d_model=d_model, d_kv=8, d_ff=48, num_layers=layers, num_decoder_layers=layers,
        num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random T5LayerNorm scales start at 1: spread them so norm updates are testable
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def t5_batch(lengths, target_lengths, pad_to: int = 0, target_pad_to: int = 0, seed: int = 0, vocab: int = 64):
    """Right-padded inputs and -100-padded labels of the given per-example lengths."""
    g = torch.Generator().manual_seed(seed)
    source = max(max(lengths), pad_to)
    target = max(max(target_lengths), target_pad_to)
    input_ids = torch.zeros(len(lengths), source, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full((len(lengths), target), -100, dtype=torch.long)
    for i, (n, m) in enumerate(zip(lengths, target_lengths)):
        input_ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
        attention_mask[i, :n] = 1
        labels[i, :m] = torch.randint(2, vocab, (m,), generator=g)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tiny_t5_world(num_tasks: int = 2, seed: int = 0, batches: int = 2, pad_to: int = 0, target_pad_to: int = 0):
    base = tiny_t5(seed)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    data = {}
    for i, task in enumerate(experts):
        data[task] = [
            t5_batch([5 + b, 9, 3 + i], [2, 4 + b, 3], pad_to, target_pad_to, seed=100 * i + b) for b in range(batches)
        ]
    return base, experts, merged, data


# ---- tiny decoder-only causal LMs (Llama with grouped-query attention, Mistral, Qwen2, Gemma-2) --------------

CAUSAL_LM_VOCAB = 64


def tiny_causal_lm(arch: str, seed: int = 0, layers: int = 2, hidden: int = 32, attn_implementation: str = "sdpa",
                   vocab: int = None):
    """A random ``*ForCausalLM`` of the given architecture: 4 query heads over 2 key/value heads, windows of 4
    tokens where the architecture has sliding-window layers (Mistral: every layer; Gemma-2: every other)."""
    import transformers

    common = dict(
        vocab_size=vocab or CAUSAL_LM_VOCAB, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        tie_word_embeddings=False,
    )
    extra = {
        "llama": {},
        "mistral": {"sliding_window": 4},
        "qwen2": {},
        "gemma2": {"head_dim": hidden // 4, "sliding_window": 4, "query_pre_attn_scalar": hidden // 4},
    }[arch]
    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    }[arch]
    config = getattr(transformers, config_cls)(**common, **extra)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                # Random RMSNorm scales start at 1 (Gemma: offsets at 0): spread them so norm updates are testable.
                p.uniform_(-0.5, 0.5) if arch == "gemma2" else p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases start at 0
                p.normal_(0.0, 0.1)
    return model


def causal_lm_batch(lengths, seed: int = 0, pad_to: int = 0, left: bool = False, vocab: int = CAUSAL_LM_VOCAB):
    """Padded ``input_ids`` / ``attention_mask`` rows of the given lengths (pad id 0), and a ``response_mask``
    marking the second half of every row as the response."""
    g = torch.Generator().manual_seed(seed)
    width = max(max(lengths), pad_to)
    batch = {key: torch.zeros(len(lengths), width, dtype=torch.long) for key in ("input_ids", "attention_mask", "response_mask")}
    for i, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        batch["input_ids"][i, span] = torch.randint(1, vocab, (n,), generator=g)
        batch["attention_mask"][i, span] = 1
        response = torch.zeros(n, dtype=torch.long)
        response[n // 2:] = 1
        batch["response_mask"][i, span] = response
    return batch


def tiny_causal_lm_world(arch: str, num_tasks: int = 2, seed: int = 0, batches: int = 2, left: bool = False):
    base = tiny_causal_lm(arch, seed)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    data = {
        task: [causal_lm_batch([9, 5 + b, 3 + i, 7], seed=100 * i + b, pad_to=10, left=left) for b in range(batches)]
        for i, task in enumerate(experts)
    }
    return base, experts, merged, data


def causal_lm_forward(model, batch):
    """The model's own forward at the positions ``generate`` gives a padded batch."""
    from featcal_fusionbench.families.causal_lm import position_ids_from_mask

    mask = batch["attention_mask"]
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask))


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer(chat_template=None):
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_image_encoder(
    seed: int = 0, layers: int = 3, width: int = 32, layer_scale: Optional[float] = None, quick_gelu: bool = True,
    batch_first: bool = True,
):
    """What FusionBench's OpenCLIP pool returns (an ``ImageEncoder`` around an open_clip ``CLIP`` with its text
    transformer removed), built tiny and offline: ``ImageEncoder(name)`` would download the OpenAI weights.
    ``batch_first=False`` gives the (L, N, D) blocks of towers pickled by open_clip 2.0.2."""
    import open_clip
    from fusion_bench.models.open_clip import ImageEncoder

    torch.manual_seed(seed)
    clip = open_clip.CLIP(
        embed_dim=16,
        vision_cfg={"image_size": 16, "patch_size": 8, "width": width, "layers": layers, "head_width": width // 4,
                    "mlp_ratio": 2.0, "ls_init_value": layer_scale},
        text_cfg={"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
        quick_gelu=quick_gelu,
    )
    del clip.transformer  # as ImageEncoder(keep_lang=False) does
    with torch.no_grad():  # open_clip starts norms at (1, 0): spread them so that their updates are visible
        for name, p in clip.visual.named_parameters():
            if ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    if not batch_first:
        clip.visual.transformer.batch_first = False
        for block in clip.visual.transformer.resblocks:
            block.attn.batch_first = False
    encoder = ImageEncoder.__new__(ImageEncoder)
    nn.Module.__init__(encoder)
    encoder.model = clip.eval()
    encoder.train_preprocess = open_clip.image_transform(16, is_train=True)
    encoder.val_preprocess = open_clip.image_transform(16, is_train=False)
    encoder.cache_dir = None
    return encoder.eval()


def tiny_openclip_world(num_tasks: int = 2, seed: int = 0, batches: int = 3, batch_size: int = 4, **encoder):
    base = tiny_image_encoder(seed, **encoder)
    experts = {f"task{i}": perturbed(base, 0.05, seed + 10 + i) for i in range(num_tasks)}
    merged = task_arithmetic(base, list(experts.values()), 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    data = {t: [torch.randn(batch_size, 3, 16, 16, generator=g) for _ in range(batches)] for t in experts}
    return base, experts, merged, data
