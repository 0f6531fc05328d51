"""Keep torch's fused inference paths from skipping layers that have a forward of their own.

In evaluation without gradients, ``nn.TransformerEncoderLayer`` runs one fused kernel
(``torch._transformer_encoder_layer_fwd``) with its layers' weights, never calling ``linear1``,
``linear2`` or its attention; ``nn.TransformerEncoder`` turns a padded batch into a nested tensor
for it. A layer given a forward of its own (fp8, a precision, a routed attention) or a call of its own (O2's
copies) would then be skipped: the evaluation would compute in another precision than the training did, silently.
:func:`keep_layers_called` turns the fused path off where it would skip such a layer, as torch
itself does where a module inside the layer has a hook: the layer's attention's ``out_proj`` (never called: the
attention reads its weight) or else the layer gets a no-op forward pre-hook, and its encoder stops making nested
tensors (padded positions then hold computed values, not zeros). On ``out_proj`` the hook costs the training
forward nothing; on the layer, every call takes ``_call_impl``'s slower path.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["keep_layers_called"]

_MARK = "_mixprec_keeps_layers_called"


def _no_fused_path(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that does nothing: its presence turns the encoder layer's fused path off."""


def _has_own_forward(module: nn.Module) -> bool:
    """A forward of its own, or a call of its own (O2's copies put in place around it), inside ``module``."""
    return any("forward" in m.__dict__ or "_call_impl" in m.__dict__ for m in module.modules())


def _uncalled(layer: nn.TransformerEncoderLayer) -> nn.Module:
    """A module inside ``layer`` its forward never calls (torch's attention reads ``out_proj.weight``), else the
    layer: a hook there turns the fused path off without running."""
    attention = layer.self_attn
    if type(attention) is nn.MultiheadAttention and isinstance(attention.out_proj, nn.Linear):
        return attention.out_proj
    return layer


def keep_layers_called(model: nn.Module) -> int:
    """Turn torch's fused encoder path off where a layer inside has a forward of its own (in place;
    idempotent); returns how many encoder layers were newly marked."""
    marked = 0
    for layer in model.modules():
        if not isinstance(layer, nn.TransformerEncoderLayer) or _MARK in layer.__dict__:
            continue
        if _has_own_forward(layer):
            _uncalled(layer).register_forward_pre_hook(_no_fused_path)
            layer.__dict__[_MARK] = True
            marked += 1
    for encoder in model.modules():
        if isinstance(encoder, nn.TransformerEncoder) and any(_MARK in m.__dict__ for m in encoder.layers):
            encoder.use_nested_tensor = False
    return marked
