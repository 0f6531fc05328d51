"""What tune learns about the machine and the model before and between its rounds.

The profile of one step (seconds per op, forward and backward), how much slower a dtype's matmul
is than fp32's (an emulated dtype), what a first step should cost, whether the model has
convolution weights. Everything here syncs with the device: it times work.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from mixprec._src import profiling, timing
from mixprec._src.tune.trial import Trial

__all__ = ["COLD_SLOW", "first_step_s", "has_conv_weights", "matmul_slowdown", "profile"]

COLD_SLOW = 10.0  # ... or this much slower on its first (cold) step than the first round's: an emulated dtype


def profile(trial: Trial, lower: frozenset[str]) -> dict[str, float]:
    """Seconds per op of ``lower`` (forward and its backward) in one step of ``trial``.

    Backward work is attributed to the forward op through the autograd sequence number the
    profiler records on both (the op whose outermost ancestor on ``lower`` created the node).
    """
    prof = profiling.profiled(trial.step, cuda=trial.device.type == "cuda")
    events = prof.events() or []
    backward = "autograd::engine::evaluate_function: "
    on_device = trial.device.type == "cuda"

    def cost(e: Any) -> float:
        return float(getattr(e, "device_time_total", 0.0) if on_device else e.cpu_time_total) * 1e-6

    def owner(e: Any) -> str | None:
        """The outermost op of ``lower`` around ``e`` in forward; None in backward (its ops are attributed below)."""
        found = None
        while e is not None:
            if e.name.startswith(backward):
                return None
            if e.name.startswith("aten::") and e.name[6:] in lower:
                found = e.name[6:]
            e = e.cpu_parent
        return found

    totals: dict[str, float] = {}
    by_seq: dict[int, str] = {}
    for e in events:
        if e.name.startswith(backward):
            continue
        op = owner(e)
        if op is None:
            continue
        if e.sequence_nr >= 0:
            by_seq.setdefault(e.sequence_nr, op)
        if e.name[6:] == op and (e.cpu_parent is None or owner(e.cpu_parent) is None):
            totals[op] = totals.get(op, 0.0) + cost(e)
    for e in events:
        if e.name.startswith(backward) and e.sequence_nr in by_seq:
            op = by_seq[e.sequence_nr]
            totals[op] = totals.get(op, 0.0) + cost(e)
    return totals


def matmul_slowdown(dtype: torch.dtype, device: torch.device) -> float:
    """How many times slower a matmul runs in ``dtype`` than in fp32 here (best of five, 256x256).

    Where a CPU has no instructions for a dtype, torch emulates it, often 10-100x slower than fp32.
    """

    def best(dt: torch.dtype) -> float:
        a = torch.full((256, 256), 0.5, device=device, dtype=dt)  # values do not matter; the RNG is the caller's
        times = []
        for _ in range(5):
            timing.sync(device)
            begin = time.perf_counter()
            a @ a
            timing.sync(device)
            times.append(time.perf_counter() - begin)
        return min(times)

    return best(dtype) / max(best(torch.float32), 1e-9)


def first_step_s(forward_s: float, dtypes: list[torch.dtype], device: torch.device) -> dict[torch.dtype, float]:
    """A first step's cost by dtype, before any ran: three fp32 forwards (forward, backward, step), slowed
    by the dtype's matmul slowdown where that is large (an emulated dtype; otherwise 0: not needed)."""
    estimates = {}
    for dtype in dtypes:
        slowdown = 1.0 if dtype is torch.float32 else matmul_slowdown(dtype, device)
        if slowdown >= COLD_SLOW:
            estimates[dtype] = 3 * forward_s * slowdown
    return estimates


def has_conv_weights(model: nn.Module) -> bool:
    return any(p.dim() in (4, 5) for p in model.parameters())
