"""mixprec's per-thread state, as torch keeps its autocast state per thread.

:func:`state` is this thread's :class:`ThreadState`: the policy in force per device (and the ones
opened by code being traced), the stack of open regions (:class:`OpenRegion`, each with what
closing it restores), the weight-cast cache, the module-rule bookkeeping and the checkpoint
capture depth. The dispatch kernels, regions, module rules and checkpoint replay all read it.
Nothing here syncs with the device.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from mixprec._src.policy.rules import Policy

__all__ = ["OpenRegion", "ThreadState", "state"]


@dataclasses.dataclass
class OpenRegion:
    """One open region (or kept module) on a thread's stack, with what closing it restores."""

    device_type: str
    torch_state: Any  # torch's autocast context to exit, or (enabled, dtype) outside a kept module
    prev_policy: Policy | None
    prev_edited: Policy | None
    plan: tuple[Any, ...]  # the kernels it holds (see acquire)
    traced: bool  # opened by compiled code while it was traced


class ThreadState:
    """Per-thread mixprec state (torch keeps its autocast state thread-local too)."""

    def __init__(self) -> None:
        # device type -> policy in force (absent: torch's built-in list for the device)
        self.policy: dict[str, Policy] = {}
        # the same for regions opened by compiled code while it is traced: Dynamo guards on what
        # traced code reads, so the module hooks read these through a constant-folded call
        self.traced_policy: dict[str, Policy] = {}
        # device type -> the policy the registered kernels apply (absent: torch's list)
        self.edited: dict[str, Policy] = {}
        # open regions and kept modules, innermost last
        self.regions: list[OpenRegion] = []
        # id(fp32 leaf) -> (weakref to it, its low-precision copy, grad mode at cast)
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, bool]] = {}
        self.switched_on: dict[str, Any] = {}
        # module-rule bookkeeping: (module, qualified name, state to restore or None)
        self.module_stack: list[tuple[Any, str, Any]] = []
        # parent module -> {(parent's name, id(child)): child's qualified name}
        self.module_names: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], str]] = weakref.WeakKeyDictionary()
        self.rule_users = 0
        # >0 while a checkpointed forward runs under mixprec.checkpoint_context
        self.captured = 0


_tls = threading.local()


def state() -> ThreadState:
    """This thread's mixprec state."""
    found: ThreadState | None = getattr(_tls, "state", None)
    if found is None:
        found = _tls.state = ThreadState()
    return found
