"""The bytes a backward holds beyond what its forward saved, from a backward run on fake tensors.

At the start of backward every tensor the forward saved is alive; as backward runs, each op makes
its outputs (the gradients of activations in flight, the parameters' gradients, an op's own
intermediate results) and the graph frees the saved tensors it no longer needs. On a model of wide
activations and few parameters (the bench's convolutional workloads) the gradients of the
activations in flight are what the peak holds beyond the saved ones: two or three activations'
worth at the worst op. :class:`BackwardTimeline` records, under ``FakeTensorMode`` (no memory, no
compute), each storage backward makes (on creation) and frees, and each saved one it frees (a
finalizer on the storage: torch keeps one Python object per live storage), in order;
:func:`peak` reads the most bytes alive above the saved ones, with the parameters' gradients as
the recipe will store them, or left out where each is stepped and freed as it is made. Only
storages an op returns are seen: a kernel's internal workspace is not. Nothing syncs.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["BackwardTimeline", "peak", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views of one storage count once)."""
    return int(t.untyped_storage()._cdata)


class BackwardTimeline(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records, while entered, the storages ops make and the storages freed (see the module). Each storage
    made is numbered (a freed storage's address is reused: the number tells them apart)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[tuple[int, int]] = []  # (number of a storage, +bytes made / -bytes freed), in order
        self.made: dict[int, tuple[int, int]] = {}  # storage key -> (its number, bytes): made and alive
        self.recording = False

    def saved(self, t: torch.Tensor) -> None:
        """Watch ``t``'s storage, saved for backward: its freeing is recorded (while recording)."""
        st = t.untyped_storage()
        weakref.finalize(st, self._saved_freed, st.nbytes())

    def number(self, t: torch.Tensor) -> int | None:
        """The number of ``t``'s storage, where an op made it while recording and it is alive."""
        made = self.made.get(storage_key(t))
        return None if made is None else made[0]

    def _saved_freed(self, nbytes: int) -> None:
        if self.recording:
            self.events.append((-1, -nbytes))

    def _made_freed(self, key: int) -> None:
        number, nbytes = self.made.pop(key, (-1, 0))
        if self.recording and nbytes:
            self.events.append((number, -nbytes))

    def __enter__(self) -> BackwardTimeline:
        self.recording = True
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __exit__(self, *args: Any) -> None:
        self.recording = False
        super().__exit__(*args)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = storage_key(t)  # a view or an in-place result is an input's storage: nothing made
                if key not in self.made and key not in inputs and st.nbytes():
                    number = len(self.events)
                    self.made[key] = (number, st.nbytes())
                    self.events.append((number, st.nbytes()))
                    weakref.finalize(st, self._made_freed, key)
        return out


def peak(events: list[tuple[int, int]], grads: Mapping[int, int | None]) -> int:
    """The most bytes alive at once above the saved tensors at backward's start, over ``events``;
    ``grads``: number of a storage holding a parameter's gradient -> the bytes the recipe stores it in
    (``None``: left out, stepped and freed as it is made)."""
    alive = most = 0
    for number, nbytes in events:
        if number in grads:
            stored = grads[number]
            if stored is None:
                continue
            nbytes = stored if nbytes > 0 else -stored
        alive += nbytes
        most = max(most, alive)
    return most
