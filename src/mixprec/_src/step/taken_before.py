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

__all__ = ["TakenBefore"]


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
