"""Step counts kept on the host beside the optimizer's ``state["step"]`` tensors: :class:`HostCounts`.

A step that reads no device value needs its counts on the host; they are re-read from a tensor only where it was
replaced or written since (a loaded checkpoint, a count set by hand).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.numerics import fp32_nearest

__all__ = ["HostCounts"]


class HostCounts:
    """Each weight's step count on the host beside its ``state["step"]`` tensor, so a step reads none of them.

    :meth:`advance` adds one to every step tensor in one multi-tensor add and returns the new counts, as the
    tensors hold them (fp32). A count is read from its tensor (``float``, a read of a CPU tensor) only where
    the tensor is not the one last counted or was written since (its version moved: a loaded checkpoint, a
    count set by hand).
    """

    def __init__(self) -> None:
        self.held: dict[int, tuple[torch.Tensor, int, float]] = {}  # id(param) -> (its step tensor, version, count)

    def advance(self, params: list[torch.Tensor], states: list[dict[str, Any]]) -> list[float]:
        steps = [st["step"] for st in states]
        before = []
        for p, t in zip(params, steps, strict=True):
            held = self.held.get(id(p))
            fresh = held is not None and held[0] is t and held[1] == t._version
            before.append(held[2] if fresh else float(t))  # type: ignore[index]
        if steps:
            torch._foreach_add_(steps, 1.0)
        after = [_as_stored(t, c + 1.0) for t, c in zip(steps, before, strict=True)]
        for p, t, c in zip(params, steps, after, strict=True):
            self.held[id(p)] = (t, t._version, c)
        return after


def _as_stored(t: torch.Tensor, value: float) -> float:
    """``value`` as the step tensor ``t`` holds it (fp32 counts stop at 2**24, as torch's do)."""
    if t.dtype is not torch.float32 or (value.is_integer() and -_EXACT <= value <= _EXACT):  # fp32 holds it as is
        return value
    return fp32_nearest(value)


_EXACT = float(1 << 24)
