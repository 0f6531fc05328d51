"""Numerics shared across subsystems: how far a low-precision result is from fp32's (the per-layer plan, the fp8
report), fp32 rounded to bf16 in a way compilers keep (Kahan-compensated weights), and fp32 arithmetic on the
host as ATen's CPU loops make it (the optimizer steps' scalars)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import struct
from collections.abc import Callable

import torch

__all__ = ["bf16_nearest", "fp32_nearest", "fp32_pow", "sqnr"]


def sqnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf where ``x`` equals the reference, -inf where it holds an
    inf or NaN the reference does not; syncs)."""
    noise = float((x.double() - reference.double()).norm())
    signal = float(reference.double().norm())
    if noise == 0:
        return math.inf
    return 20 * math.log10(signal / noise) if signal > 0 and math.isfinite(noise) else -math.inf


def fp32_nearest(value: float) -> float:
    """A Python float rounded to the nearest fp32 value (ties to even, as a cast), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]  # type: ignore[no-any-return]


@functools.cache
def fp32_pow() -> Callable[[float, float], float] | None:
    """The C library's ``powf``, which ATen's CPU ``pow`` calls for an fp32 tensor shorter than a vector (its
    element-wise loop's ``std::pow``): ``fp32_pow()(b, e)`` is ``torch.tensor([b]) ** torch.tensor(e)`` bit for bit,
    on the host, for fp32 values ``b`` and ``e``. ``None`` where the library is not found."""
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        powf = ctypes.CDLL(name).powf
    except (OSError, AttributeError):
        return None
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return powf  # type: ignore[no-any-return]


def bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), returned in fp32: ``x.to(bf16).float()``
    for finite values, in integer arithmetic. inductor fuses ``x.to(bf16).float()`` into ``x`` (it does not
    emulate intermediate casts by default), which would make a compensation ``x - rounded`` zero; this form
    it keeps."""
    raw = x.view(torch.int32)
    kept = (raw + 0x7FFF + ((raw >> 16) & 1)) & -(1 << 16)
    return kept.view(torch.float32)
