"""A tensorwise fp8 cast in three launches (two Triton kernels), for eager fp8 linears on CUDA.

Eager, :func:`~mixprec._src.fp8.gemm.gemm` casts an operand with about ten ATen ops (``abs``, ``amax``, the scale's
arithmetic, an fp32 copy, ``mul``, ``clamp``, ``to``, a transposing copy, the scale's reciprocal), each a pass over
memory or a launch: on an H200 a 1.1B Llama's fp8 linears ran at half of bf16's speed. Here the same cast is

1. ``amax_tiles`` (``fp8/cast_kernels.py``): each tile's largest magnitude (NaN where the tile holds one);
2. ``amax`` over the tiles (one small ATen reduction; NaN propagates);
3. ``cast_tiles``: each program makes the scale from the amax as :func:`~mixprec._src.fp8.gemm.scale_from_amax`
   does (``(1 / amax) * max`` in fp64, as torch computes a number over a tensor, then to fp32), then writes
   ``clamp(t * scale, -max, max)`` rounded to the fp8 format to nearest even, in the layout the GEMM takes
   (row-major for its first operand, column-major for its second: no copy after); the first program stores the
   scale and its reciprocal (the GEMM's), rounded as ATen's ``reciprocal``.

The rounding is integer arithmetic on the fp32 bits (no conversion instruction), so the kernels compute the same
bits on a GPU and in Triton's interpreter on a CPU, where the tests hold them to the ATen ops bit for bit. Taken only
where the ops would be the same ones: tensorwise scales not rounded to powers of two, e4m3fn or e5m2, a CUDA tensor
with int32 offsets, not while compiling (inductor fuses the ops itself) and not under a dispatch mode (which must see
the ops). With ``scale`` given (delayed scaling), only the cast runs. Delayed scaling's scale (from the tensor's
amax history, the amax now recorded) takes :func:`delayed_scale`: the first kernel, then one program that folds the
tiles and the history, makes the scale and keeps the amax (``delayed_scale`` in the kernels' module). Nothing syncs
with the host.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from typing import Any
from unittest import mock

import torch

from mixprec._src import dispatch_modes

__all__ = ["BLOCK", "ENV", "Kernels", "amax", "build", "cast", "delayed_scale", "eligible", "has_triton", "usable"]

#: a tile's rows and columns (a program's share of a cast)
BLOCK = 64
#: the fp8 formats the kernels round to: (exponent bias, mantissa bits, NaN's bits)
_FORMATS = {torch.float8_e4m3fn: (7, 3, 0x7F), torch.float8_e5m2: (15, 2, 0x7F)}
#: off with ``MIXPREC_FUSED_FP8_CAST=0`` (the ATen ops then, as on the CPU): for comparisons
ENV = "MIXPREC_FUSED_FP8_CAST"
_MODULE = "mixprec._src.fp8.cast_kernels"


class Kernels:
    """The two Triton kernels (``fp8/cast_kernels.py``) and Triton's ``cdiv``."""

    def __init__(self, module: Any, block: int = BLOCK) -> None:
        self.amax_tiles, self.cast_tiles, self.cdiv = module.amax_tiles, module.cast_tiles, module.triton.cdiv
        self.delayed_scale = module.delayed_scale
        self.block = block


def build(interpret: bool = False, block: int = BLOCK) -> Kernels:
    """The kernels, on tiles of ``block`` x ``block``; with ``interpret``, a copy of their module that Triton's
    interpreter runs (numpy, on CPU tensors: ``TRITON_INTERPRET=1`` must then be set while they run too)."""
    if not interpret:
        return Kernels(importlib.import_module(_MODULE), block)
    spec = importlib.util.find_spec(_MODULE)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # read as each function is decorated
        spec.loader.exec_module(copy)
    return Kernels(copy, block)


@functools.cache
def _kernels() -> Kernels:
    return build()


@functools.cache
def has_triton() -> bool:
    """Whether Triton can be imported (CUDA builds of torch bring it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def usable(t: torch.Tensor, dtype: torch.dtype | None, rowwise: bool, power_of_two: bool) -> bool:
    """Whether :func:`cast` computes this operand's cast (else the ATen ops do: the same bits)."""
    if not (t.is_cuda and t.dim() == 2 and eligible(dtype, rowwise, power_of_two)):  # (compiling: no shape read)
        return False
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return extent < 2**31 - 1 and t.numel() < 2**31  # the kernels' offsets are int32


def eligible(dtype: torch.dtype | None, rowwise: bool, power_of_two: bool) -> bool:
    """Whether a cast of this kind may run in the kernels here and now (the device and shape aside)."""
    return (
        dtype in _FORMATS
        and not rowwise
        and not power_of_two
        and not torch.compiler.is_compiling()
        and not dispatch_modes.active()
        and os.environ.get(ENV, "1") != "0"
        and has_triton()
    )


def cast(
    t: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    *,
    column_major: bool = False,
    eps: float,
    kernels: Kernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(q, amax, scale, 1 / scale)`` of the 2-d ``t`` cast tensorwise to ``dtype``: ``q`` row-major, or
    column-major where ``column_major``; ``amax`` is None where ``scale`` was given. ``kernels``: others than the
    CUDA ones (tests)."""
    with _on_device_of(t):
        return _cast(t, dtype, scale, column_major, eps, kernels if kernels is not None else _kernels())


def amax(t: torch.Tensor, *, kernels: Kernels | None = None) -> torch.Tensor:
    """The fp32 amax of the 2-d ``t``, as ``t.abs().amax().float()``: one read, no ``abs`` copy."""
    with _on_device_of(t):
        return _amax(t, kernels if kernels is not None else _kernels())


def _on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """``t``'s GPU made the current one (Triton launches on the current device); nothing for a CPU tensor."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def delayed_scale(
    t: torch.Tensor,
    row: torch.Tensor,
    pending: torch.Tensor,
    dtype: torch.dtype,
    *,
    most_recent: bool,
    margin: int,
    record: bool,
    eps: float,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """Delayed scaling's fp32 scale of the 2-d ``t`` in ``dtype`` from its amax history ``row`` (contiguous fp32:
    its largest amax, or ``most_recent`` its first; ``t``'s own amax where that is not positive), ``margin`` powers
    of two below; with ``record``, ``t``'s amax (where finite) kept in the 0-d ``pending`` as a max, in place. Two
    launches (each tile's amax, then one program for the rest) where ``fp8/linear.py``'s ATen ops take about
    fifteen; the same bits."""
    with _on_device_of(t):
        k = kernels if kernels is not None else _kernels()
        tiles = _tiles(t, k)
        scale = torch.empty((), dtype=torch.float32, device=t.device)
        k.delayed_scale[(1,)](
            tiles, tiles.numel(), row, row.numel(), pending, scale, RECORD=record, MOST_RECENT=most_recent, EPS=eps,
            FP8_MAX=float(torch.finfo(dtype).max), MARGIN=float(2.0**margin), BLOCK=_FOLD,
        )  # fmt: skip
    if record:
        torch.autograd.graph.increment_version(pending)  # as the in-place write it replaces
    return scale


#: the values one program of ``delayed_scale`` folds at a time
_FOLD = 1024


def _tiles(t: torch.Tensor, k: Kernels) -> torch.Tensor:
    grid = (k.cdiv(t.shape[0], k.block), k.cdiv(t.shape[1], k.block))
    tiles = torch.empty(grid, dtype=torch.float32, device=t.device)
    k.amax_tiles[grid](t, tiles, t.shape[0], t.shape[1], t.stride(0), t.stride(1), BLOCK=k.block)
    return tiles


def _amax(t: torch.Tensor, k: Kernels) -> torch.Tensor:
    tiles = _tiles(t, k)
    return tiles.amax()  # NaN where a tile holds one, as the amax of ``t``


def _cast(
    t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None, column_major: bool, eps: float, k: Kernels
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    bias, mantissa, nan = _FORMATS[dtype]
    fp8_max = float(torch.finfo(dtype).max)
    rows, cols = t.shape
    grid = (k.cdiv(rows, k.block), k.cdiv(cols, k.block))
    amax = None
    if scale is None:
        amax = _amax(t, k)
        scale = torch.empty((), dtype=torch.float32, device=t.device)
    inverse = torch.empty((), dtype=torch.float32, device=t.device)
    q = (
        torch.empty((cols, rows), dtype=dtype, device=t.device).t()
        if column_major
        else t.new_empty(t.shape, dtype=dtype)
    )
    codes = q.view(torch.uint8)
    strides = (t.stride(0), t.stride(1), codes.stride(0), codes.stride(1))
    k.cast_tiles[grid](
        t, amax if amax is not None else scale, scale, inverse, codes, rows, cols, *strides,
        FROM_AMAX=amax is not None, EPS=eps, FP8_MAX=fp8_max, BIAS=bias, MANTISSA=mantissa, NAN=nan, BLOCK=k.block,
    )  # fmt: skip
    return q, amax, scale, inverse
