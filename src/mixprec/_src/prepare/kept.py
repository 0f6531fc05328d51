"""Modules kept in fp32 at every level: hooks on each kept module turn autocast off inside it and cast its
floating inputs to fp32. torch's own norm layers whose forward is one op the policy leaves in fp32
(``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``) get a forward of their own instead, the same op on
fp32 inputs: the same numbers without two hooks a call.

The hooks belong to the module, so they run wherever the module runs (a checkpoint's recompute,
FSDP2, a copy of the model) and read only torch's own autocast state; under ``torch.compile``
the switches are graph nodes, undone if a trace stops early. A per-thread stack holds the
state outside each kept module. Nothing here syncs with the device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._src import bound_forward, casting
from mixprec._src.amp import compiled_backward, region
from mixprec._src.policy.rules import OpCategory, Policy
from mixprec._src.prepare.config import PrepareConfig

__all__ = ["OwnForward", "keep_in_fp32", "outermost", "param_ids"]


def outermost(model: nn.Module, config: PrepareConfig) -> list[nn.Module]:
    """The modules ``config`` keeps, without those inside another kept one."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if config.keeps(module, name) and not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            found.append((name, module))
    return [m for _, m in found]


def param_ids(modules: Iterable[nn.Module]) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


_keep = threading.local()


def _keep_stack() -> list[tuple[bool, torch.dtype] | None]:
    stack: list[tuple[bool, torch.dtype] | None] | None = getattr(_keep, "stack", None)
    if stack is None:
        stack = _keep.stack = []
    return stack


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _keep_enter(device_type: str) -> None:
    """Enter a kept module: autocast off for ``device_type`` (the state outside is restored on exit)."""
    stack = _keep_stack()
    if torch.compiler.is_compiling():
        region.unwind_on_failed_trace_with(functools.partial(_keep_exit_to, device_type, len(stack)))
        compiled_backward.backward_like_eager()
    enabled = torch.is_autocast_enabled(device_type)
    stack.append((enabled, torch.get_autocast_dtype(device_type)) if enabled else None)
    if enabled:
        torch.set_autocast_enabled(device_type, False)


@torch.fx.node.has_side_effect
@torch._dynamo.allow_in_graph  # type: ignore[untyped-decorator]
def _keep_exit(device_type: str) -> None:
    outside = _keep_stack().pop()
    if outside is not None:
        torch.set_autocast_enabled(device_type, outside[0])
        torch.set_autocast_dtype(device_type, outside[1])


def _keep_exit_to(device_type: str, depth: int) -> None:
    while len(_keep_stack()) > depth:
        _keep_exit(device_type)


def _enter(device_type: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    cast_inputs = torch.is_autocast_enabled(device_type)
    _keep_enter(device_type)
    if not cast_inputs:
        return None
    return casting.cast_floating((args, kwargs), torch.float32, device_type)


def _leave(device_type: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    _keep_exit(device_type)


_fp32 = torch.float32


def _fp32_input(device_type: str, input: torch.Tensor) -> torch.Tensor:
    """The input a kept module's hooks would give it: cast to fp32 where autocast is on (eligible tensors)."""
    if torch.compiler.is_compiling():
        compiled_backward.backward_like_eager()
    if input.dtype is not _fp32 and torch.is_autocast_enabled(device_type) and casting.eligible(input, device_type):
        return input.float()
    return input  # fp32 already (O1's stream): nothing to check


def _layer_norm(device_type: str, module: nn.LayerNorm, input: torch.Tensor) -> torch.Tensor:
    input = _fp32_input(device_type, input)
    return F.layer_norm(input, module.normalized_shape, module.weight, module.bias, module.eps)


def _group_norm(device_type: str, module: nn.GroupNorm, input: torch.Tensor) -> torch.Tensor:
    return F.group_norm(_fp32_input(device_type, input), module.num_groups, module.weight, module.bias, module.eps)


def _rms_norm(device_type: str, module: nn.RMSNorm, input: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(_fp32_input(device_type, input), module.normalized_shape, module.weight, module.eps)


# torch's norm layers whose forward is one functional call: the call's ATen op and the same call on fp32 inputs
_OWN_FORWARDS: dict[type[nn.Module], tuple[str, Any]] = {
    nn.LayerNorm: ("layer_norm", _layer_norm),
    nn.GroupNorm: ("group_norm", _group_norm),
    nn.RMSNorm: ("rms_norm", _rms_norm),
}


class OwnForward:
    """The handle of a kept module's own forward: ``remove()`` gives the module its class's forward back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _own_forward(module: nn.Module, policy: Policy) -> Any:
    """The forward that keeps ``module`` in fp32 without hooks, or ``None`` where only the hooks keep it right:
    a subclass (its forward may differ), a forward of its own already, or a policy that runs the op in low
    precision or has module rules (the hooks turn autocast off inside the module; this forward does not)."""
    found = _OWN_FORWARDS.get(type(module))
    if found is None or "forward" in module.__dict__ or policy.module_rules:
        return None
    op, forward = found
    return forward if policy.category_of(op) in (None, OpCategory.FP32) else None


def keep_in_fp32(
    modules: Iterable[nn.Module], device_type: str, handles: list[Any], policy: Policy | None = None
) -> None:
    """Keep each module in fp32: autocast off inside it, floating inputs cast to fp32.

    What keeps it belongs to the module, so it runs wherever the module runs: in a checkpoint's
    recompute, under FSDP2, in a copy of the model (``copy.deepcopy``, ``torch.save``); torch's own
    autocast state is all it reads. torch's norm layers get a forward of their own where ``policy`` (the
    prepared forward's) leaves their op in fp32: fp32 inputs, the same op, no hooks; the rest get hooks.
    """
    enter, leave = functools.partial(_enter, device_type), functools.partial(_leave, device_type)
    for module in modules:
        own = None if policy is None else _own_forward(module, policy)
        if own is not None:
            bound_forward.bind(module, functools.partial(own, device_type))
            handles.append(OwnForward(module))
            continue
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
