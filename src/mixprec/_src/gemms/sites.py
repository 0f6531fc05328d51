"""A model's GEMM layers, by name, and the modules holding a GEMM's weight that are not layers, with why.

:func:`gemm_layers` is the one enumeration every per-layer feature uses (fp8 conversion, per-layer
precision, the per-layer plan, the guard, the fp8 report); it routes the model's attentions first
(:func:`attention.route`), so their projections are layers too. No sync.
"""

from __future__ import annotations

from torch import nn

from mixprec._src.gemms import attention, fused_paths
from mixprec._src.gemms.kinds import Kind, kind_of, not_a_layer

__all__ = ["attention_of", "gemm_layers", "left_out", "settle"]


def attention_of(model: nn.Module, name: str) -> nn.MultiheadAttention | None:
    """The ``nn.MultiheadAttention`` whose projection (``in_proj``, ``out_proj``) the module ``name`` is, or None."""
    parent, _, last = name.rpartition(".")
    if last not in ("in_proj", "out_proj"):
        return None
    owner = model.get_submodule(parent)
    return owner if isinstance(owner, nn.MultiheadAttention) else None


def _unreached_projection(model: nn.Module, name: str) -> str | None:
    """Why the ``out_proj`` called ``name`` never runs as a module (its attention is not routed), or None."""
    owner = attention_of(model, name)
    if owner is None or attention.is_routed(owner):
        return None
    why = attention.unroutable(owner) or "its forward is another library's"
    return f"the out-projection of an nn.MultiheadAttention mixprec cannot route ({why}): its owner never calls it"


def gemm_layers(model: nn.Module, route: bool = True) -> list[tuple[str, nn.Module, Kind]]:
    """``(name, module, kind)`` of each GEMM layer of ``model``, in ``named_modules`` order.

    ``route``: route the model's attentions first (in place), so their projections are layers;
    without it, an unrouted attention's projections are left out.
    """
    if route:
        attention.route(model)
    found = []
    for name, module in model.named_modules():
        kind = kind_of(module)
        if kind is not None and _unreached_projection(model, name) is None:
            found.append((name, module, kind))
    return found


def left_out(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, reason)`` of each module that holds a GEMM's weight but is not a layer mixprec reaches."""
    out = []
    for name, module in model.named_modules():
        reason = not_a_layer(module) or (_unreached_projection(model, name) if kind_of(module) else None)
        if isinstance(module, nn.MultiheadAttention) and not attention.is_routed(module):
            why = attention.unroutable(module) or "its forward is another library's"
            out.append((name, f"nn.MultiheadAttention's in-projection: not routed ({why})"))
        if reason is not None:
            out.append((name, reason))
    return out


def settle(model: nn.Module) -> None:
    """After layers got forwards of their own: keep torch's fused inference paths from skipping them."""
    fused_paths.keep_layers_called(model)
