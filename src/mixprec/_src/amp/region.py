"""Regions: putting a policy in force on a device, and taking it out again, as a stack per thread.

:func:`push` and :func:`pop` are plain functions, so compiled code can call them as graph
nodes (:func:`enter_traced`, :func:`exit_traced`). A policy whose op lists equal torch's
for the device needs nothing beyond torch's own autocast state; one that differs acquires
dispatcher kernels (``dispatch.acquire``) while it is in force. A policy with module rules
keeps global module hooks installed while any region with rules is open: at each module
boundary they ask ``module_rules`` which rule matches and enter or leave it here.

Nothing here syncs with the device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._src import casting
from mixprec._src.amp import compiled_backward, dispatch, module_rules, thread_state
from mixprec._src.amp.thread_state import state as _state
from mixprec._src.policy.rules import POLICIES, Policy, default_policy

__all__ = ["enter_traced", "exit_traced", "needs_kernels", "pop", "pop_to", "push", "unwind_on_failed_trace"]


@functools.lru_cache(maxsize=256)
def needs_kernels(policy: Policy, device_type: str) -> bool:
    """Whether ``policy`` differs from torch's list for ``device_type`` (module rules aside)."""
    builtin = default_policy(device_type)
    return policy.output_dtype is not None or policy.op_table != builtin.op_table


# ----- entering and leaving ------------------------------------------------------------------


def push(device_type: str, policy: Policy, torch_ctx: Any, traced: bool = False) -> None:
    """Put ``policy`` in force on ``device_type``; ``torch_ctx`` is what :func:`pop` restores of torch's."""
    st = _state()
    edited = needs_kernels(policy, device_type)
    plan = dispatch.acquire(policy, device_type) if edited else ()
    table = st.traced_policy if traced else st.policy
    st.regions.append(
        thread_state.OpenRegion(
            device_type, torch_ctx, table.get(device_type), st.edited.get(device_type), plan, traced
        )
    )
    table[device_type] = policy
    if edited:
        st.edited[device_type] = policy
    else:
        st.edited.pop(device_type, None)
    if policy.module_rules:
        _count_rule_user(st, +1)


def pop() -> None:
    st = _state()
    region = st.regions.pop()
    device_type, torch_ctx = region.device_type, region.torch_state
    policies = st.traced_policy if region.traced else st.policy
    if policies[device_type].module_rules:
        _count_rule_user(st, -1)
    for table, prev in ((policies, region.prev_policy), (st.edited, region.prev_edited)):
        if prev is None:
            table.pop(device_type, None)
        else:
            table[device_type] = prev
    dispatch.release(region.plan)
    if not st.regions:
        st.cache.clear()
        st.module_stack.clear()
    if isinstance(torch_ctx, tuple):  # a kept module: torch's state outside it
        torch.set_autocast_enabled(device_type, torch_ctx[0])
        torch.set_autocast_dtype(device_type, torch_ctx[1])
    elif torch_ctx is not None:
        torch_ctx.__exit__(None, None, None)


def unwind_on_failed_trace(depth: int) -> None:
    """While Dynamo traces, close what a trace that stops early would leave open."""
    unwind_on_failed_trace_with(functools.partial(pop_to, depth))


def unwind_on_failed_trace_with(undo: Callable[[], None]) -> None:
    """While Dynamo traces, run ``undo`` when the trace ends (torch's state as it was before the trace)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no Dynamo trace in this thread
        tx = None
    if tx is None:  # AOTAutograd's trace: it runs the whole graph, exits included
        return
    tx.output.add_cleanup_hook(undo)


def pop_to(depth: int) -> None:
    """Close the regions opened after the stack was ``depth`` deep."""
    while len(_state().regions) > depth:
        pop()


# torch's autocast that Dynamo leaves alone inside a traced function (torch 2.13); before it, autocast itself
_UNMANAGED = getattr(torch.amp.autocast_mode, "_UnmanagedAutocast", torch.amp.autocast_mode.autocast)


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def enter_traced(device_type: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool, token: str) -> None:
    # Under torch.compile this is a node of the graph: Dynamo and AOTAutograd run it while
    # tracing (so the ops traced after it see the region), compiled code no longer needs it.
    unwind_on_failed_trace(len(_state().regions))
    compiled_backward.backward_like_eager()
    torch_ctx = _UNMANAGED(device_type, dtype, enabled, cache_enabled)
    torch_ctx.__enter__()  # type: ignore[no-untyped-call]
    push(device_type, POLICIES.value_for(token), torch_ctx, traced=True)


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def exit_traced(device_type: str) -> None:
    pop()


# ----- the global module hooks that module rules run on ---------------------------------------

_hooks_lock = threading.Lock()
_hook_users = 0
# The hooks sit in torch's global hook dicts under a fixed key rather than behind a
# RemovableHandle: creating a handle bumps a class counter, which Dynamo cannot trace,
# while dict stores it can, so a region with rules can open inside a compiled function.
_HOOK_KEY = -0x6D69787072  # negative: never one of torch's handle ids
_module = nn.modules.module


def _count_rule_user(st: thread_state.ThreadState, delta: int) -> None:
    """A region with rules opens (+1) or closes (-1); the first installs the hooks, the last removes them."""
    global _hook_users
    st.rule_users += delta
    with _hooks_lock:
        _hook_users += delta
        if delta > 0 and _HOOK_KEY not in _module._global_forward_pre_hooks:
            _module._global_forward_pre_hooks[_HOOK_KEY] = _pre_hook
            _module._global_forward_hooks[_HOOK_KEY] = _post_hook
            _module._global_forward_hooks_always_called[_HOOK_KEY] = True
        # While compiling, the hooks stay (the compiled frame's guards read them after tracing);
        # they do nothing while no region with rules is open, and the next eager exit removes them.
        elif delta < 0 and _hook_users == 0 and not torch.compiler.is_compiling():
            del _module._global_forward_pre_hooks[_HOOK_KEY]
            del _module._global_forward_hooks[_HOOK_KEY]
            del _module._global_forward_hooks_always_called[_HOOK_KEY]


# ----- entering and leaving a module a rule matches (the hooks above install these) ---------------------


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_enter(device_type: str, dtype: torch.dtype) -> None:
    """Enter a kept module: autocast off (fp32) or on in ``dtype``, the policy without rules."""
    st = _state()
    policy = st.traced_policy.get(device_type) or st.policy[device_type]
    dispatch.check_checkpoint(st)
    if torch.compiler.is_compiling():
        unwind_on_failed_trace(len(st.regions))
        compiled_backward.backward_like_eager()
    outside = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    if dtype is torch.float32:
        torch.set_autocast_enabled(device_type, False)
    else:
        torch.set_autocast_enabled(device_type, True)
        torch.set_autocast_dtype(device_type, dtype)
    push(device_type, policy.without_rules, outside, traced=torch.compiler.is_compiling())


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_exit(device_type: str) -> None:
    pop()


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    st = _state()
    if not torch.compiler.is_compiling() and st.rule_users == 0:
        return None
    in_force = module_rules.policies_in_force(st)
    if not any(p.module_rules for p in in_force.values()):
        return None
    name = module_rules.qualified_name(st, module)
    if isinstance(module, module_rules.OptimizedModule):
        # torch.compile's wrapper: its _orig_mod runs the hooks again and takes this name,
        # found here, eagerly. The stack holds a stand-in: Dynamo must not reach the
        # module it traces through another path.
        st.module_stack.append((module_rules.CompiledWrapper(id(module)), name, None))
        return None
    entered: list[str] = []
    new_args = None
    for device_type, policy in in_force.items():
        if not policy.module_rules or not torch.is_autocast_enabled(device_type):
            continue
        rule = module_rules.match_rule(policy.module_rules, module, name)
        if rule is None:
            continue
        _rule_enter(device_type, rule.dtype)
        entered.append(device_type)
        new_args = casting.cast_floating(args if new_args is None else new_args, rule.dtype, device_type)
    st.module_stack.append((module, name, tuple(entered)))
    return new_args


def _post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    st = _state()
    if not st.module_stack:
        return
    top = st.module_stack[-1][0]
    if top is not module and not (isinstance(top, module_rules.CompiledWrapper) and top.ident == id(module)):
        return
    _, _, entered = st.module_stack.pop()
    for device_type in reversed(entered or ()):
        _rule_exit(device_type)


# Dynamo must never compile the hooks as frames of their own (see autocast.py).
for _func in (_pre_hook, _post_hook):
    dispatch.never_a_frame(_func)
