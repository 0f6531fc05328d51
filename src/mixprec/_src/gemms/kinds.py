"""One notion of a GEMM layer: which modules are one, their weight as a linear's, their GEMM.

A GEMM layer is a module whose forward is one GEMM with a weight, ``x @ W.T + b`` or a
convolution, and which its owner calls as a module (so a forward of its own, a hook or a
precision reaches it). fp8 conversion, per-layer precision, the per-layer plan, the guard, the
fp8 report and the reach report all ask :func:`kind_of`; a new kind is added here and nowhere
else. Third-party kinds are recognised by class name and defining package, without importing it.

========================  =====================================  ==============================
kind                      modules                                weight as stored
========================  =====================================  ==============================
``linear``                ``nn.Linear`` and subclasses that      ``(out, in)``
                          keep its ``forward``
``conv1d``                transformers' ``Conv1D`` (GPT-2,       ``(in, out)``: transposed
                          OpenAI GPT, ImageGPT, ...)
``attention-in``          ``nn.MultiheadAttention``'s packed     ``(3 * embed, embed)``
                          in-projection (``attention``)
``patch``                 a convolution whose kernel is its      ``(out, in, *kernel)``: as a
                          stride (no padding, dilation or        linear, ``(out, in * kernel)``
                          groups): ViT's patch embedding
``convolution``           other ``nn.Conv1d/2d/3d`` (and         ``(out, in/groups, *kernel)``
                          subclasses that keep ``forward``)
========================  =====================================  ==============================

A patch convolution is a GEMM over non-overlapping patches: :func:`patches` lays its input out as
rows of ``in * kernel`` values (in the weight's order), :func:`unpatch` lays the GEMM's rows back.

An attention's ``out_proj`` is a ``linear`` reached once its attention is routed (its own forward
never calls ``out_proj``). Nothing here syncs with the device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATTENTION_IN",
    "CONV1D",
    "CONVOLUTION",
    "LINEAR",
    "PATCH",
    "Kind",
    "bias_of",
    "compute",
    "features",
    "flops_per_row",
    "kind_of",
    "linear_weight",
    "not_a_layer",
    "patches",
    "unpatch",
    "weight_of",
    "weight_param",
]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of GEMM layer.

    Attributes:
        name: short name (``linear``, ``conv1d``, ``attention-in``, ``convolution``).
        linear: its GEMM is ``x @ W.T + b`` over the last dim (fp8 linears take it).
        transposed: its weight is stored ``(in, out)``.
    """

    name: str
    linear: bool
    transposed: bool = False

    def __str__(self) -> str:
        return self.name


LINEAR = Kind("linear", linear=True)
CONV1D = Kind("conv1d", linear=True, transposed=True)
ATTENTION_IN = Kind("attention-in", linear=True)
PATCH = Kind("patch", linear=True)
CONVOLUTION = Kind("convolution", linear=False)

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Third-party classes by (defining package, class name): detected without importing the package.
_THIRD_PARTY = {("transformers", "Conv1D"): CONV1D}


def _defining(cls: type) -> tuple[type, Kind] | None:
    """The class in ``cls``'s MRO that makes it a kind, and the kind."""
    for base in cls.__mro__:
        if base is nn.Linear:
            return base, LINEAR
        if base in _CONVS:
            return base, CONVOLUTION
        kind = _THIRD_PARTY.get((base.__module__.split(".")[0], base.__name__))
        if kind is not None:
            return base, kind
        if getattr(base, "_mixprec_gemm_kind", None) is ATTENTION_IN:
            return base, ATTENTION_IN
    return None


def _own_forward(cls: type, base: type) -> type | None:
    """The first class between ``cls`` and ``base`` that overrides ``forward`` (``None``: none does)."""
    for klass in cls.__mro__:
        if klass is base:
            return None
        if "forward" in klass.__dict__:
            return klass
    return None


def kind_of(module: nn.Module) -> Kind | None:
    """The kind of GEMM layer ``module`` is, or ``None`` (see :func:`not_a_layer` for why)."""
    found = _defining(type(module))
    if found is None or _own_forward(type(module), found[0]) is not None:
        return None
    if found[1] is CONVOLUTION and _is_patch(module):
        return PATCH
    return found[1]


def _is_patch(conv: nn.Module) -> bool:
    c: Any = conv
    return (
        tuple(c.kernel_size) == tuple(c.stride)
        and c.groups == 1
        and set(c.dilation) == {1}
        and c.padding_mode == "zeros"
        and (c.padding == "valid" or set(c.padding) == {0})
    )


def not_a_layer(module: nn.Module) -> str | None:
    """Why a module that holds a GEMM's weight is not a layer mixprec reaches; ``None`` for a layer or a
    module with no kind at all."""
    found = _defining(type(module))
    if found is None:
        return None
    own = _own_forward(type(module), found[0])
    if own is None:
        return None
    return (
        f"{type(module).__name__} overrides {found[0].__name__}'s forward (in {own.__name__}): it may "
        "compute otherwise (a quantized or adapted layer), so it is left as it is"
    )


def weight_of(module: nn.Module) -> torch.Tensor:
    """The layer's weight as stored (for the kinds here: a parameter of the layer or of its owner)."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return weight


def bias_of(module: nn.Module) -> torch.Tensor | None:
    bias: torch.Tensor | None = getattr(module, "bias", None)
    return bias


def weight_param(module: nn.Module) -> tuple[nn.Module, str]:
    """``(module, name)`` that registers the weight parameter (an attention's in-projection: its owner's)."""
    if kind_of(module) is ATTENTION_IN:
        owner: nn.Module = module.owner  # type: ignore[assignment]
        return owner, "in_proj_weight"
    return module, "weight"


def linear_weight(module: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The weight of a linear kind as ``nn.Linear`` holds it, ``(out, in)`` (a view: gradients flow back)."""
    w = weight_of(module) if weight is None else weight
    kind = kind_of(module)
    if kind is CONV1D:
        return w.t()
    return w.reshape(w.shape[0], -1) if kind is PATCH else w


def features(module: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of the layer's GEMM per output element: a convolution's ``in`` is per group and kernel."""
    w = weight_of(module)
    kind = kind_of(module)
    if kind is CONVOLUTION:
        return int(math.prod(w.shape[1:])), int(w.shape[0])
    out, inp = linear_weight(module).shape
    return int(inp), int(out)


def flops_per_row(module: nn.Module) -> int:
    """FLOPs of the layer's GEMM per output row (a token; a convolution's output position): ``2 * in * out``."""
    inp, out = features(module)
    return 2 * inp * out


def compute(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's GEMM on ``x`` with ``weight`` (as stored) and ``bias``, in whatever dtype they have."""
    if kind_of(module) in (CONVOLUTION, PATCH):  # a patch convolution as torch convolves (the same numbers)
        return module._conv_forward(x, weight, bias)  # type: ignore[operator,no-any-return]
    return F.linear(x, linear_weight(module, weight), bias)


def patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A patch convolution's input ``(batch, in, *size)`` as rows ``(batch, *grid, in * prod(kernel))``.

    Positions past the last whole patch are dropped, as the convolution drops them.
    """
    kernel = tuple(module.kernel_size)  # type: ignore[arg-type]
    n = len(kernel)
    if x.dim() == n + 1:  # unbatched
        x = x.unsqueeze(0)
    grid = [size // k for size, k in zip(x.shape[2:], kernel, strict=True)]
    index: tuple[Any, ...] = (..., *(slice(0, g * k) for g, k in zip(grid, kernel, strict=True)))
    x = x[index]
    split = [d for g, k in zip(grid, kernel, strict=True) for d in (g, k)]
    x = x.reshape(x.shape[0], x.shape[1], *split)
    order = [0, *(2 + 2 * i for i in range(n)), 1, *(3 + 2 * i for i in range(n))]  # batch, grid, in, kernel
    return x.permute(order).reshape(x.shape[0], *grid, -1)


def unpatch(module: nn.Module, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The GEMM's rows ``(batch, *grid, out)`` as the convolution's output ``(batch, out, *grid)`` (unbatched
    where ``x`` is)."""
    n = rows.dim() - 2
    out = rows.permute(0, n + 1, *range(1, n + 1))
    return out.squeeze(0) if x.dim() == n + 1 else out
