"""``nn.MultiheadAttention``'s projections as layers: a routed forward that calls them as modules.

``nn.MultiheadAttention`` keeps its packed input projection as a parameter (``in_proj_weight``,
``(3 * embed, embed)``) and passes its ``out_proj`` to ``F.multi_head_attention_forward`` as
tensors: neither GEMM runs through a module, so nothing that acts on layers (a forward of its own,
a hook) reaches them. :func:`route` gives each attention of the common configuration (one packed
in-projection: ``kdim == vdim == embed_dim``, no ``add_bias_kv``, no ``add_zero_attn``) a child
``in_proj`` (:class:`InProjection`, no parameters of its own: it computes with its owner's) and a
forward of its own that runs self-attention as ``F.multi_head_attention_forward`` does, op for op,
with the two projections called as modules. Parameters, their names and the state dict are the
attention's; the numbers are torch's (bitwise, in fp32 and under autocast; tests/gemms), but for
an unbatched input's gradient (torch projects an unbatched query, key and value with three GEMMs,
the routed forward with one: the gradient sums the parts in another order).

A call that is not self-attention (``query``, ``key`` and ``value`` not one tensor) or on nested
tensors runs torch's own forward; its in-projection then computes as the region says, and where
``in_proj`` has a forward of its own (fp8, a precision) a warning says so, once per attention.
Routed attentions never take torch's fused inference path (``torch._native_multi_head_attention``),
whose numbers differ from the training path's. Nothing here syncs with the device.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._src import bound_forward
from mixprec._src.gemms import kinds

__all__ = ["InProjection", "attentions", "is_routed", "route", "unroutable"]


class InProjection(nn.Module):
    """An attention's packed input projection as a layer: ``F.linear(x, owner.in_proj_weight, owner.in_proj_bias)``.

    It registers no parameter (the state dict keeps the attention's keys); ``weight`` and ``bias``
    are its owner's.
    """

    _mixprec_gemm_kind = kinds.ATTENTION_IN
    owner: Any  # the nn.MultiheadAttention (a plain attribute, not a child)

    def __init__(self, owner: nn.MultiheadAttention) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a child: the attention holds this, not the reverse

    @property
    def weight(self) -> torch.Tensor:
        weight: torch.Tensor = self.owner.in_proj_weight
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        bias: torch.Tensor | None = self.owner.in_proj_bias
        return bias

    @property
    def in_features(self) -> int:
        return int(self.owner.embed_dim)

    @property
    def out_features(self) -> int:
        return 3 * int(self.owner.embed_dim)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (packed q, k, v of its attention)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def unroutable(attention: nn.MultiheadAttention) -> str | None:
    """Why an attention's projections cannot be routed through modules, or ``None``."""
    if not attention._qkv_same_embed_dim:
        return "separate q/k/v weights (kdim or vdim differ from embed_dim): not a packed in-projection"
    if attention.bias_k is not None:
        return "add_bias_kv=True"
    if attention.add_zero_attn:
        return "add_zero_attn=True"
    return None


def attentions(model: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]


def is_routed(attention: nn.Module) -> bool:
    return bound_forward.bound_function(attention) is routed_forward


def route(model: nn.Module) -> list[str]:
    """Route every routable attention of ``model`` (in place; idempotent); returns the names newly routed."""
    newly = []
    for name, attention in attentions(model):
        if is_routed(attention) or unroutable(attention) is not None:
            continue
        if "forward" in attention.__dict__:  # another library's forward: left as it is
            continue
        attention.in_proj = InProjection(attention)
        # in_proj first among the children, as the forward calls it (no parameters: the state dict keeps its order)
        attention._modules = {"in_proj": attention._modules.pop("in_proj"), **attention._modules}
        attention.__dict__["_mixprec_told_cross"] = False
        bound_forward.bind(attention, routed_forward)
        newly.append(name)
    return newly


def _torch_forward(self: nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
    if "forward" in self.in_proj.__dict__ and not self.__dict__.get("_mixprec_told_cross", True):
        self.__dict__["_mixprec_told_cross"] = True
        warnings.warn(
            f"{type(self).__name__} was called with query, key and value not one tensor (cross-attention) "
            "or nested: its in-projection computed as torch's MultiheadAttention does, not in the "
            "precision set on its in_proj (which reaches self-attention calls); out_proj keeps its own",
            UserWarning,
            stacklevel=3,
        )
    return nn.MultiheadAttention.forward(self, *args, **kwargs)


def routed_forward(
    self: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward``'s training path for self-attention, projections called as modules."""
    if query is not key or key is not value or query.is_nested:
        return _torch_forward(  # type: ignore[no-any-return]
            self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
    # As nn.MultiheadAttention.forward before F.multi_head_attention_forward.
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    is_batched = query.dim() == 3
    if self.batch_first and is_batched:
        query = query.transpose(1, 0)
    # As F.multi_head_attention_forward, self-attention with a packed in-projection.
    num_heads = self.num_heads
    is_batched = F._mha_shape_check(  # type: ignore[attr-defined]
        query, query, query, key_padding_mask, attn_mask, num_heads
    )
    if not is_batched:
        query = query.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = tgt_len
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
            "method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != self.embed_dim:
        raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    proj = self.in_proj(query)  # type: ignore[operator]  # the packed in-projection, as a layer
    proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = proj[0], proj[1], proj[2]
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                    f"{(bsz * num_heads, tgt_len, src_len)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    dropout_p = self.dropout if self.training else 0.0
    weights: torch.Tensor | None = None
    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
    else:
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = self.out_proj(out)  # the out-projection, as a layer
    out = out.view(tgt_len, bsz, out.size(1))
    if weights is not None:
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            weights = weights.squeeze(0)
    if not is_batched:
        out = out.squeeze(1)
    if self.batch_first and is_batched:
        out = out.transpose(1, 0)
    return out, weights
