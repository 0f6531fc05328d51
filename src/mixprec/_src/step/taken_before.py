"""What a list kernel took at a weight's last step: :class:`TakenBefore`.

A list step checks each weight's tensors before it takes them (dtype, device, layout: ``cpu_lists.takes``,
``cpu_adam.bf16_available``). A weight's state tensors keep their dtype, device and layout while they are the same
tensors, so a weight whose state is the one taken at its last step needs only its own checks again. Nothing here
holds a tensor alive: the references are weak, and one gone never matches.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mixprec._src import sharding
from mixprec._src.optim import cpu_lists

__all__ = ["TakenBefore", "bf16_adam_row"]


class TakenBefore:
    """``id(param) -> (key, weak references to the param and its state tensors)`` as :meth:`note` saw them."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[Any, tuple[weakref.ref[torch.Tensor], ...]]] = {}

    def same(self, p: torch.Tensor, key: Any, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        """Whether :meth:`note` saw ``p`` with this ``key`` (what else the caller checked: dtypes, sizes) and these
        very ``tensors`` (none of them ``None``, none gone since)."""
        found = self.held.get(id(p))
        if found is None or found[0] != key or len(found[1]) != len(tensors) + 1 or found[1][0]() is not p:
            return False
        for ref, t in zip(found[1][1:], tensors, strict=True):  # a loop: every weight at every step  # noqa: SIM110
            if t is None or ref() is not t:
                return False
        return True

    def note(self, p: torch.Tensor, key: Any, tensors: tuple[torch.Tensor, ...]) -> None:
        """Remember that the list took ``p`` with ``key`` and ``tensors``."""
        self.held[id(p)] = (key, tuple(weakref.ref(t) for t in (p, *tensors)))


def bf16_adam_row(
    p: torch.Tensor, state: tuple[torch.Tensor, ...], taken: TakenBefore, local_of: Any
) -> list[Any] | None:
    """A bf16 weight's row of ``cpu_lists.adam_step``: ``p``'s weight, gradient and moments as the kernel takes
    them (``state``: its moments, and its compensation if any), or ``None``. One taken before with this very state
    has its own dtype and device checked alone (its layout is the caller's to check)."""
    grad = p.grad
    low = torch.bfloat16
    if taken.same(p, None, state) and p.dtype is low and grad.dtype is low and p.is_cpu and grad.is_cpu:  # type: ignore[union-attr]
        return [p, grad, *state[:2]]
    local = [local_of(t) for t in (p.data, grad, *state[:2])]
    if not cpu_lists.takes(*local, *state[2:]):
        return None
    if not sharding.is_sharded(p):  # a shard's local tensors are made anew at each step
        taken.note(p, None, state)
    return local
