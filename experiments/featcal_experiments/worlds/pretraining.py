"""Contrastive pretraining of the offline world's tiny CLIP: image-text InfoNCE plus, optionally, SimCLR on two
augmented views of each image (SLIP, Mu et al. 2022).

Why the image-image term: most pretraining captions name only an image's domain ("a handwritten digit"), as web
alt-texts rarely name a benchmark's classes. Image-text InfoNCE alone then pulls every image of a domain onto that one
caption and the base's features collapse within the domain (a linear probe on them is barely above a random
network's). Instance discrimination keeps them apart, so the base has features worth fine-tuning while its zero-shot
heads stay weak: the pretrained-model regime of real CLIP.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm


def augment(pixels: Tensor, generator: torch.Generator) -> Tensor:
    """A random view of each image: zoom (crop 0.65-1 of the side), shift, rotation within +-10 degrees, and
    brightness / contrast jitter. No flips: digits and letters are not symmetric."""
    n = pixels.shape[0]

    def uniform(low, high, *shape):
        return torch.empty(n, *shape).uniform_(low, high, generator=generator)

    scale, angle = uniform(0.65, 1.0), uniform(-0.17, 0.17)
    shift_x, shift_y = uniform(-1.0, 1.0) * (1 - scale), uniform(-1.0, 1.0) * (1 - scale)
    cos, sin = scale * angle.cos(), scale * angle.sin()
    theta = torch.stack([torch.stack([cos, -sin, shift_x], 1), torch.stack([sin, cos, shift_y], 1)], 1)
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    views = F.grid_sample(pixels, grid, padding_mode="border", align_corners=False)
    return views * uniform(0.7, 1.3, 1, 1, 1) + uniform(-0.3, 0.3, 1, 1, 1)


def _info_nce(logits: Tensor, same: Tensor) -> Tensor:
    """Symmetric InfoNCE; pairs whose captions name the same thing are not each other's negatives."""
    logits = logits.masked_fill(same & ~torch.eye(len(same), dtype=torch.bool), float("-inf"))
    target = torch.arange(len(same))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def _simclr(z1: Tensor, z2: Tensor, temperature: float = 0.1) -> Tensor:
    z = F.normalize(torch.cat([z1, z2]), dim=-1)
    n = len(z1)
    sim = (z @ z.T / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def pretrain_clip(
    model, tokenizer, pixels: Tensor, captions: List[str], caption_ids: Tensor, *, steps: int, batch_size: int,
    lr: float, ssl_weight: float, generator: torch.Generator,
) -> List[float]:
    """AdamW with one-cycle decay; returns the image-text loss per step. ``caption_ids`` says which captions name the
    same thing (same id: not negatives). With ``ssl_weight > 0`` the image side sees two augmented views, one of
    which meets the text, and a throw-away MLP head carries the SimCLR term."""
    width = model.config.vision_config.hidden_size
    head = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 64)) if ssl_weight else None
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    tokens = tokenizer(captions, padding=True, truncation=True, max_length=32, return_tensors="pt")
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="pretraining the tiny CLIP", mininterval=10):
        idx = torch.randint(len(captions), (batch_size,), generator=generator)
        images = pixels[idx]
        if head is not None:
            images, second = augment(images, generator), augment(images, generator)
        pooled = model.vision_model(pixel_values=images).pooler_output
        image_emb = F.normalize(model.visual_projection(pooled), dim=-1)
        text_emb = F.normalize(
            model.get_text_features(input_ids=tokens["input_ids"][idx], attention_mask=tokens["attention_mask"][idx]),
            dim=-1,
        )
        ids = caption_ids[idx]
        loss = _info_nce(model.logit_scale.exp() * image_emb @ text_emb.T, ids[:, None] == ids[None, :])
        losses.append(loss.item())
        if head is not None:
            loss = loss + ssl_weight * _simclr(head(pooled), head(model.vision_model(pixel_values=second).pooler_output))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return losses
