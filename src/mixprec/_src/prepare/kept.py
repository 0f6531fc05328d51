"""Modules kept in fp32 at every level: hooks on each kept module turn autocast off inside it and cast its
floating inputs to fp32.

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
from torch import nn

from mixprec._src import casting
from mixprec._src.amp import compiled_backward, region
from mixprec._src.prepare.config import PrepareConfig

__all__ = ["keep_in_fp32", "outermost", "param_ids"]


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


def keep_in_fp32(modules: Iterable[nn.Module], device_type: str, handles: list[Any]) -> None:
    """Hooks on each kept module: autocast off inside it, floating inputs cast to fp32.

    The hooks belong to the module, so they run wherever the module runs: in a checkpoint's
    recompute, under FSDP2, in a copy of the model (``copy.deepcopy``, ``torch.save``); torch's own
    autocast state is all they read.
    """
    enter, leave = functools.partial(_enter, device_type), functools.partial(_leave, device_type)
    for module in modules:
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
