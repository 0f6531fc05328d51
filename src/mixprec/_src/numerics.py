"""Numerics shared by the per-layer plan and the fp8 report: how far a low-precision result is from fp32's."""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr"]


def sqnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf where ``x`` equals the reference, -inf where it holds an
    inf or NaN the reference does not; syncs)."""
    noise = float((x.double() - reference.double()).norm())
    signal = float(reference.double().norm())
    if noise == 0:
        return math.inf
    return 20 * math.log10(signal / noise) if signal > 0 and math.isfinite(noise) else -math.inf
