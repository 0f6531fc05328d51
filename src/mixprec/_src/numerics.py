"""Numerics shared across subsystems: how far a low-precision result is from fp32's (the per-layer plan, the fp8
report), and fp32 rounded to bf16 in a way compilers keep (Kahan-compensated weights)."""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["bf16_nearest", "fp32_nearest", "sqnr"]


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


def bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), returned in fp32: ``x.to(bf16).float()``
    for finite values, in integer arithmetic. inductor fuses ``x.to(bf16).float()`` into ``x`` (it does not
    emulate intermediate casts by default), which would make a compensation ``x - rounded`` zero; this form
    it keeps."""
    raw = x.view(torch.int32)
    kept = (raw + 0x7FFF + ((raw >> 16) & 1)) & -(1 << 16)
    return kept.view(torch.float32)
