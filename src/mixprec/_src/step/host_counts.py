"""Step counts kept on the host beside the optimizer's ``state["step"]`` tensors: :class:`HostCounts`.

A step that reads no device value needs its counts on the host; they are re-read from a tensor only where it was
replaced or written since (a loaded checkpoint, a count set by hand).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src import dispatch_modes
from mixprec._src.numerics import fp32_nearest
from mixprec._src.optim import cpu_lists

__all__ = ["EXACT", "HostCounts", "write"]


class HostCounts:
    """Each weight's step count on the host beside its ``state["step"]`` tensor, so a step reads none of them.

    :meth:`advance` adds one to every step tensor (on the CPU written in one C++ call, elsewhere one multi-tensor
    add) and returns the new counts, as the tensors hold them (fp32). A count is read from its tensor (``float``,
    a read of a CPU tensor) only where the tensor is not the one last counted or was written since (its version
    moved: a loaded checkpoint, a count set by hand).
    """

    def __init__(self) -> None:
        self.held: dict[int, tuple[torch.Tensor, int, float]] = {}  # id(param) -> (its step tensor, version, count)

    def advance(self, params: list[torch.Tensor], states: list[dict[str, Any]]) -> list[float]:
        held = self.held
        steps, after, ids = [], [], []
        for p, st in zip(params, states, strict=True):
            t, key = st["step"], id(p)
            last = held.get(key)
            count = (last[2] if last is not None and last[0] is t and last[1] == t._version else float(t)) + 1.0
            if t.dtype is torch.float32 and not (count.is_integer() and count <= EXACT and count >= -EXACT):
                count = fp32_nearest(count)  # as the tensor holds it: fp32 counts stop at 2**24, as torch's do
            steps.append(t)
            after.append(count)
            ids.append(key)
        if steps:
            write(steps, after)
        for key, t, count in zip(ids, steps, after, strict=True):
            held[key] = (t, t._version, count)
        return after


def write(steps: list[torch.Tensor], after: list[float]) -> None:
    """The new counts into the step tensors: one C++ call where every one is a CPU fp32 scalar and no dispatch mode
    is on (the values an fp32 add of one makes: ``after``), else one multi-tensor add, which a mode sees."""
    if not dispatch_modes.active() and cpu_lists.counts_build():
        for t in steps:  # a loop, not all() over a generator: this runs at every step
            if t.dtype is not torch.float32 or not t.is_cpu or t.numel() != 1 or type(t) is not torch.Tensor:
                break
        else:
            cpu_lists.write_counts(steps, after)
            return
    torch._foreach_add_(steps, 1.0)


EXACT = float(1 << 24)  # fp32 step counts are exact up to here
