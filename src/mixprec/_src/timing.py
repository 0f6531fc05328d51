"""Timing on a shared machine: the clock tune reads, and how noisy its readings were.

A step's time on a shared machine moves with everything else running there. :func:`tune` and its
per-layer plan estimate speed robustly (the median step, the fastest run) and, beside each
estimate, how far the same estimate moved between repetitions:

* :func:`ratio_noise`: for a median of per-step speed ratios (a candidate against a baseline run
  in lockstep), the half-width of an approximate 95% interval of that median, from the ratios'
  median absolute deviation (robust: one step slowed by a stall barely moves it), relative to it;
* :func:`fastest_noise`: for the fastest of repeated runs, the gap between the two fastest
  relative to the fastest.

A choice between two things whose difference is within that noise is not a measurement: tune
keeps the simpler one and says so. Nothing here syncs a device: callers sync before reading the clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

__all__ = ["NOISY", "clock", "fastest_noise", "ratio_noise", "sync"]

#: Relative noise above which a measurement is repeated (while the budget allows).
NOISY = 0.05
# A median's standard error is about 1.2533 sigma / sqrt(n), sigma about 1.4826 MAD (normal data); 1.96 of them.
_MEDIAN_95 = 1.96 * 1.2533 * 1.4826


def clock() -> float:
    """Seconds, for timing steps (``time.perf_counter``; tests replace it with a noisy one)."""
    return time.perf_counter()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ratio_noise(ratios: Sequence[float]) -> float | None:
    """How uncertain the median of ``ratios`` is, relative to it: the half-width of an approximate 95%
    interval, ``1.96 * 1.2533 * 1.4826 * MAD / sqrt(n) / median`` (``None`` for fewer than 2 ratios)."""
    if len(ratios) < 2:
        return None
    middle = statistics.median(ratios)
    if middle <= 0:
        return None
    mad = statistics.median(abs(r - middle) for r in ratios)
    return _MEDIAN_95 * mad / math.sqrt(len(ratios)) / middle


def fastest_noise(seconds: Sequence[float]) -> float | None:
    """How much slower the second-fastest of ``seconds`` was than the fastest (``None`` for fewer than 2)."""
    if len(seconds) < 2:
        return None
    first, second = sorted(seconds)[:2]
    return (second - first) / first if first > 0 else None
