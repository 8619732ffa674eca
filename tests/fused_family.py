"""A family whose attention is torch's fused ``nn.MultiheadAttention`` (OpenCLIP's layout), registered here
only for the tests: q, k and v are rows of one ``in_proj_weight`` and ``out_proj``'s input is computed inside
the functional attention call. That the whole contract suite passes on it is what shows the registry can
express such sites."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from featcal_fusionbench.families import LayerNormSite, LinearSite, ModelFamily, register_family
from featcal_fusionbench.families.sites import MHAOutProjSite, mha_in_proj_sites


class FusedBlock(nn.Module):
    """OpenCLIP's ResidualAttentionBlock: pre-norm fused self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(width, 2 * width), gelu=nn.GELU(), c_proj=nn.Linear(2 * width, width))
        )

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyFusedEncoder(nn.Module):
    def __init__(self, in_features: int = 6, width: int = 16, heads: int = 4, layers: int = 2):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(FusedBlock(width, heads) for _ in range(layers))
        self.ln_post = nn.LayerNorm(width)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


@register_family
class FusedAttentionFamily(ModelFamily):
    name = "test_fused_attention"

    @classmethod
    def supports(cls, model):
        return isinstance(model, TinyFusedEncoder)

    def blocks(self, model):
        return list(model.blocks)

    def stem_modules(self, model):
        return [model.stem]

    def embed(self, model, inputs):
        return model.stem(inputs.to(model.stem.weight.dtype)), None

    def run_block(self, block, hidden, meta):
        return block(hidden)

    def sites(self, block):
        found = {"ln_1": LayerNormSite(block.ln_1)}
        found.update({f"attn.in_proj.{part}": site for part, site in mha_in_proj_sites(block.attn).items()})
        found["attn.out_proj"] = MHAOutProjSite(block.attn)
        found["ln_2"] = LayerNormSite(block.ln_2)
        found["mlp.c_fc"] = LinearSite(block.mlp.c_fc)
        found["mlp.c_proj"] = LinearSite(block.mlp.c_proj)
        return found

    def batches(self, modelpool, dataset, batch_size, shuffle=False, seed=0):
        return iter(dataset)


def tiny_fused(seed: int = 0) -> TinyFusedEncoder:
    torch.manual_seed(seed)
    model = TinyFusedEncoder().eval()
    with torch.no_grad():  # random norms start at (1, 0): spread them so their updates are visible
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model
