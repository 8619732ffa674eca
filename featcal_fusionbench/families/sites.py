"""Calibrated sites: the units of a block whose parameters FeatCal solves for.

A site says how its input is captured during a block's forward, how its parameters are read and
written, and (for linear maps) its output width. The engine sees only sites, so a family whose
parameters are not one ``nn.Linear`` each (a fused q/k/v weight, an input computed inside a
functional call) is expressed by one more site class, not by engine changes.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..core.moments import layer_norm_without_affine, rms_norm_without_scale

LINEAR = "linear"
LAYERNORM = "layernorm"
RMSNORM = "rmsnorm"
SCALE = "scale"  # an elementwise scale of the raw input (a layer scale): solved as a scale-only norm
NORM_KINDS = (LAYERNORM, RMSNORM, SCALE)

OnTensor = Callable[[Tensor], None]


def first_tensor(args, kwargs) -> Tensor:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor):
            return value
    raise RuntimeError("a calibrated module was called without a tensor input")


def _copy_into(target: Tensor, value: Tensor) -> None:
    with torch.no_grad():
        target.copy_(value.to(dtype=target.dtype, device=target.device))


class Site:
    """One calibrated unit of one block of one model (the same name in the merged, base and expert blocks)."""

    kind: str = "abstract"

    @property
    def weight(self) -> Optional[Tensor]:
        raise NotImplementedError

    @property
    def bias(self) -> Optional[Tensor]:
        raise NotImplementedError

    def write(self, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> None:
        """Copy solved values in place, in the parameters' own dtype and device."""
        raise NotImplementedError

    def hooks(self, on_input: OnTensor, on_output: Optional[OnTensor] = None) -> List[RemovableHandle]:
        """Register hooks that report the site's input (and output) each time the block runs."""
        raise NotImplementedError


class ModuleSite(Site):
    """A module whose own ``weight`` and ``bias`` are the site's parameters and whose call is its map."""

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def weight(self):
        return self.module.weight

    @property
    def bias(self):
        return getattr(self.module, "bias", None)

    def write(self, weight=None, bias=None):
        if weight is not None:
            _copy_into(self.module.weight, weight)
        if bias is not None:
            _copy_into(self.module.bias, bias)

    def hooks(self, on_input, on_output=None):
        handles = [self.module.register_forward_pre_hook(lambda _m, a, k: on_input(first_tensor(a, k)), with_kwargs=True)]
        if on_output is not None:
            handles.append(self.module.register_forward_hook(lambda _m, _a, out: on_output(out)))
        return handles


class LinearSite(ModuleSite):
    """An ``nn.Linear`` (or any module computing x W^T + b with ``out_features``)."""

    kind = LINEAR

    @property
    def out_features(self) -> int:
        return self.module.out_features


class RowsSite(Site):
    """Rows ``rows`` of a fused weight (and bias) owned by ``owner``, e.g. q, k or v of a packed ``in_proj``.

    The input is captured by a forward pre-hook on ``input_module`` (``input_of`` picks it from the call's
    arguments; by default the first tensor), and the output, where wanted, is computed from that input:
    a fused weight's rows have no module of their own whose output could be hooked.
    """

    kind = LINEAR

    def __init__(
        self, owner: nn.Module, weight_name: str, bias_name: Optional[str], rows: slice, input_module: nn.Module,
        input_of: Callable = first_tensor,
    ):
        self.owner, self.weight_name, self.bias_name, self.rows = owner, weight_name, bias_name, rows
        self.input_module, self.input_of = input_module, input_of

    @property
    def weight(self):
        return getattr(self.owner, self.weight_name)[self.rows]

    @property
    def bias(self):
        bias = getattr(self.owner, self.bias_name) if self.bias_name else None
        return None if bias is None else bias[self.rows]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def write(self, weight=None, bias=None):
        if weight is not None:
            _copy_into(getattr(self.owner, self.weight_name)[self.rows], weight)
        if bias is not None:
            _copy_into(getattr(self.owner, self.bias_name)[self.rows], bias)

    def hooks(self, on_input, on_output=None):
        def pre_hook(_module, args, kwargs):
            x = self.input_of(args, kwargs)
            on_input(x)
            if on_output is not None:
                on_output(F.linear(x, self.weight, self.bias))

        return [self.input_module.register_forward_pre_hook(pre_hook, with_kwargs=True)]


class NormSite(ModuleSite):
    """A normalisation's elementwise affine: ``weight`` scales, ``bias`` (if any) shifts ``normalize(x)``."""

    def normalizer(self) -> Callable[[Tensor], Tensor]:
        raise NotImplementedError

    @property
    def dim(self) -> int:
        return self.module.weight.shape[0]


class LayerNormSite(NormSite):
    kind = LAYERNORM

    def normalizer(self):
        return layer_norm_without_affine(self.module.normalized_shape, self.module.eps)


class RMSNormSite(NormSite):
    """Scale-only RMSNorm (T5LayerNorm, LlamaRMSNorm): ``weight * x / rms(x)``; the epsilon is read from
    ``variance_epsilon`` or ``eps``."""

    kind = RMSNORM

    def normalizer(self):
        eps = getattr(self.module, "variance_epsilon", getattr(self.module, "eps", 1e-6))
        return rms_norm_without_scale(eps)


# ---- torch's nn.MultiheadAttention (OpenCLIP's attention): fused q/k/v rows, out_proj inside a functional call --


def mha_query(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["query"]


def mha_in_proj_sites(attention: nn.MultiheadAttention) -> dict:
    """q, k and v as rows of ``in_proj_weight`` (self-attention: all three read the query)."""
    if not attention._qkv_same_embed_dim:
        raise TypeError("separate q/k/v projection weights are not a fused in_proj; calibrate them as linears")
    d = attention.embed_dim
    return {
        part: RowsSite(attention, "in_proj_weight", "in_proj_bias", slice(i * d, (i + 1) * d), attention, mha_query)
        for i, part in enumerate("qkv")
    }


class MHAOutProjSite(LinearSite):
    """``out_proj`` of an ``nn.MultiheadAttention``: its weight is read inside the functional attention, so
    hooks on the module never fire. The input (the heads' concatenated outputs) is recomputed from the
    attention's own arguments with the output projection set to the identity (self-attention, no masks:
    the blocks that use this site must pass none)."""

    def __init__(self, attention: nn.MultiheadAttention):
        super().__init__(attention.out_proj)
        self.attention = attention

    def _heads_output(self, args, kwargs) -> Tensor:
        mha = self.attention
        query = mha_query(args, kwargs)
        for name in ("key_padding_mask", "attn_mask"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"MHAOutProjSite does not support {name}")
        x = query.transpose(0, 1) if mha.batch_first else query
        eye = torch.eye(mha.embed_dim, dtype=x.dtype, device=x.device)
        out, _ = F.multi_head_attention_forward(
            x, x, x, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
            eye, None, training=False, need_weights=False,
        )
        return out.transpose(0, 1) if mha.batch_first else out

    def hooks(self, on_input, on_output=None):
        def pre_hook(_module, args, kwargs):
            x = self._heads_output(args, kwargs)
            on_input(x)
            if on_output is not None:
                on_output(F.linear(x, self.module.weight, self.module.bias))

        return [self.attention.register_forward_pre_hook(pre_hook, with_kwargs=True)]
