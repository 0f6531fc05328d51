"""Module rules: which of a policy's per-module rules applies to a module as it is called.

While a region whose policy has rules is open, ``region``'s global forward pre-hook names each
module called (:func:`qualified_name`, from the outermost module; torch.compile's wrapper takes
its module's name), finds the first rule that matches (:func:`match_rule`) among the policies in
force (:func:`policies_in_force`, those opened by code being traced included), switches torch's
autocast state for the module (off for fp32, on in the rule's dtype) with the policy without its
rules in force, and casts the module's floating inputs; the post-hook restores the state. This
module answers the questions; ``region`` does the switching (so neither imports the other
both ways).

Nothing here syncs with the device.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._src.amp import thread_state
from mixprec._src.amp.thread_state import state as _state
from mixprec._src.policy.rules import POLICIES, ModuleRule, Policy

__all__ = ["CompiledWrapper", "OptimizedModule", "match_rule", "policies_in_force", "qualified_name"]

OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class CompiledWrapper:
    """Stands in for a torch.compile wrapper module on the module stack."""

    def __init__(self, ident: int) -> None:
        self.ident = ident


def qualified_name(st: thread_state.ThreadState, module: nn.Module) -> str:
    if not st.module_stack:
        return ""
    parent, parent_name, _ = st.module_stack[-1]
    if isinstance(parent, CompiledWrapper):  # torch.compile's wrapper runs only its _orig_mod: same name
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


def match_rule(rules: tuple[ModuleRule, ...], module: nn.Module, name: str) -> ModuleRule | None:
    for rule in rules:
        if rule.matches(module, name):
            return rule
    return None


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_policy_tokens() -> tuple[tuple[str, str], ...]:
    # Constant-folded while Dynamo traces: the regions it names were opened by the traced
    # code itself (their policies are arguments of its graph nodes, so already guarded).
    return tuple((d, p.compile_token) for d, p in _state().traced_policy.items())


def policies_in_force(st: thread_state.ThreadState) -> dict[str, Policy]:
    if not torch.compiler.is_compiling():
        return st.policy
    return {**st.policy, **{d: POLICIES.value_for(token) for d, token in _traced_policy_tokens()}}
