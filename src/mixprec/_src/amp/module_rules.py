"""Module rules: a policy's per-module dtypes, applied at module boundaries by global forward hooks.

While a region whose policy has rules is open, a pre-hook names each module called (its
qualified name from the outermost module), finds the first rule that matches, switches
torch's autocast state for the module (off for fp32, on in the rule's dtype) with the policy
without its rules in force, and casts the module's floating inputs; the post-hook restores
the state. Under torch.compile the switches are graph nodes.

Nothing here syncs with the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._src import casting
from mixprec._src.amp import compiled_backward, dispatch, region, thread_state
from mixprec._src.amp.thread_state import state as _state
from mixprec._src.policy import interning
from mixprec._src.policy.policy import ModuleRule, Policy

__all__: list[str] = []

_OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class _CompiledWrapper:
    """Stands in for a torch.compile wrapper module on the module stack."""

    def __init__(self, ident: int) -> None:
        self.ident = ident


def _qualified_name(st: thread_state.ThreadState, module: nn.Module) -> str:
    if not st.module_stack:
        return ""
    parent, parent_name, _ = st.module_stack[-1]
    if isinstance(parent, _CompiledWrapper):  # torch.compile's wrapper runs only its _orig_mod: same name
        return str(parent_name)
    compiling = torch.compiler.is_compiling()  # then names are worked out once, at trace time
    # Names are cached per parent and the parent's name: a module reached from another root
    # (a submodule called on its own) has another qualified name.
    names = None if compiling else st.module_names.setdefault(parent, {})
    key = (parent_name, id(module))
    name = None if names is None else names.get(key)
    if name is not None:
        return name
    for child_name, child in parent.named_modules():
        if child is module and child_name:
            if "_orig_mod" in child_name:  # under a torch.compile wrapper: name it as the plain model does
                child_name = ".".join(part for part in child_name.split(".") if part != "_orig_mod")
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            break
    else:
        name = f"{parent_name}.<{type(module).__name__}>" if parent_name else f"<{type(module).__name__}>"
    if names is not None:
        names[key] = name
    return name


def _match_rule(rules: tuple[ModuleRule, ...], module: nn.Module, name: str) -> ModuleRule | None:
    for rule in rules:
        if rule.matches(module, name):
            return rule
    return None


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_enter(device_type: str, dtype: torch.dtype) -> None:
    """Enter a kept module: autocast off (fp32) or on in ``dtype``, the policy without rules."""
    st = _state()
    policy = st.traced_policy.get(device_type) or st.policy[device_type]
    dispatch.check_checkpoint(st)
    if torch.compiler.is_compiling():
        region.unwind_on_failed_trace(len(st.regions))
        compiled_backward.backward_like_eager()
    outside = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    if dtype is torch.float32:
        torch.set_autocast_enabled(device_type, False)
    else:
        torch.set_autocast_enabled(device_type, True)
        torch.set_autocast_dtype(device_type, dtype)
    region.push(device_type, policy.without_rules, outside, traced=torch.compiler.is_compiling())


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _rule_exit(device_type: str) -> None:
    region.pop()


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_policy_tokens() -> tuple[tuple[str, str], ...]:
    # Constant-folded while Dynamo traces: the regions it names were opened by the traced
    # code itself (their policies are arguments of its graph nodes, so already guarded).
    return tuple((d, p.compile_token) for d, p in _state().traced_policy.items())


def _policies_in_force(st: thread_state.ThreadState) -> dict[str, Policy]:
    if not torch.compiler.is_compiling():
        return st.policy
    return {**st.policy, **{d: interning.policy_for(token) for d, token in _traced_policy_tokens()}}


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    st = _state()
    if not torch.compiler.is_compiling() and st.rule_users == 0:
        return None
    in_force = _policies_in_force(st)
    if not any(p.module_rules for p in in_force.values()):
        return None
    name = _qualified_name(st, module)
    if isinstance(module, _OptimizedModule):
        # torch.compile's wrapper: its _orig_mod runs the hooks again and takes this name,
        # found here, eagerly. The stack holds a stand-in: Dynamo must not reach the
        # module it traces through another path.
        st.module_stack.append((_CompiledWrapper(id(module)), name, None))
        return None
    entered: list[str] = []
    new_args = None
    for device_type, policy in in_force.items():
        if not policy.module_rules or not torch.is_autocast_enabled(device_type):
            continue
        rule = _match_rule(policy.module_rules, module, name)
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
    if top is not module and not (isinstance(top, _CompiledWrapper) and top.ident == id(module)):
        return
    _, _, entered = st.module_stack.pop()
    for device_type in reversed(entered or ()):
        _rule_exit(device_type)


region.set_rule_hooks(_pre_hook, _post_hook)
# Dynamo must never compile the hooks as frames of their own (see autocast.py).
for _func in (_pre_hook, _post_hook):
    dispatch.never_a_frame(_func)
