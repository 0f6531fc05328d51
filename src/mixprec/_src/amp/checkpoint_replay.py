"""Checkpoint replay: a recompute under ``torch.utils.checkpoint`` runs with the policy it ran with.

torch's checkpoint replays torch's autocast state, not a mixprec policy's edited ops or
module rules: :func:`checkpoint_context` snapshots them in the forward and puts them back
in force for the recompute. ``dispatch.check_checkpoint`` refuses a recompute that would
run without them.

Nothing here syncs with the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from mixprec._src.amp import region
from mixprec._src.amp.thread_state import state as _state
from mixprec._src.policy.rules import Policy

__all__ = ["Snapshot", "checkpoint_context", "replay", "snapshot"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a replay needs of mixprec's state: the policies in force that differ from torch's
    lists, per device, and the module the code runs in (its children are named from it)."""

    policies: dict[str, Policy]
    module: tuple[Any, str] | None


def snapshot() -> Snapshot:
    st = _state()
    policies = {d: p for d, p in st.policy.items() if p.module_rules or region.needs_kernels(p, d)}
    module = (st.module_stack[-1][0], st.module_stack[-1][1]) if st.module_stack and policies else None
    return Snapshot(policies, module)


@contextlib.contextmanager
def _capture() -> Iterator[None]:
    st = _state()
    st.captured += 1
    try:
        yield
    finally:
        st.captured -= 1


@contextlib.contextmanager
def replay(snapshot: Snapshot) -> Iterator[None]:
    """Put a snapshot's policies back in force; torch's own autocast state is replayed by the caller."""
    st = _state()
    depth, stack_depth = len(st.regions), len(st.module_stack)
    st.captured += 1
    try:
        for device_type, policy in snapshot.policies.items():
            region.push(device_type, policy, None)
        if snapshot.module is not None:  # modules called in the replay are named from here
            st.module_stack.append((*snapshot.module, ()))
        yield
    finally:
        del st.module_stack[stack_depth:]
        region.pop_to(depth)
        st.captured -= 1


def checkpoint_context(
    inner: Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]
    | None = None,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that replays the mixprec policy in its recompute.

    torch's checkpoint replays torch's autocast state (enabled, dtype) but knows
    nothing of a mixprec policy's edited ops or module rules. Pass this function
    as ``checkpoint(fn, *args, use_reentrant=False, context_fn=mixprec.checkpoint_context)``
    (Hugging Face: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs=
    {"use_reentrant": False, "context_fn": mixprec.checkpoint_context})``, before transformers 5
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``). Without it, checkpointing a
    region whose policy differs from torch's raises instead of computing other
    gradients. With a built-in policy it is not needed (and harmless). To combine it with
    another ``context_fn`` (selective checkpointing), pass that one as ``inner``:
    ``context_fn=functools.partial(mixprec.checkpoint_context, inner=other_context_fn)``.

    Example:
        >>> import torch, mixprec
        >>> from torch.utils.checkpoint import checkpoint
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> policy = mixprec.get_policy("cpu").keep_modules(torch.nn.LayerNorm)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = checkpoint(net, x, use_reentrant=False, context_fn=mixprec.checkpoint_context)
        >>> y.float().sum().backward()
    """
    if inner is None:
        return _capture(), replay(snapshot())
    forward, recompute = inner()
    return _both(_capture(), forward), _both(replay(snapshot()), recompute)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[Any], second: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield
