"""Unscaling gradients and flagging inf/NaN: torch's fused kernel, grouped, and agreed across ranks.

Nothing here syncs with the device; :func:`agree` queues an all-reduce.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "agree",
    "first_device",
    "grads_of",
    "inverse",
    "manual_sources",
    "summed",
    "unscale_and_check",
    "unscale_manually",
]


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, taken in fp64: fp32 division can be inexact under some compile options."""
    return scale.double().reciprocal().float()


def grads_of(optimizer: torch.optim.Optimizer, allow_fp16: bool = True) -> list[torch.Tensor]:
    """The gradients of ``optimizer``'s parameters (a sparse one's values, coalesced when fp16).

    Raises:
        ValueError: an fp16 gradient with ``allow_fp16=False`` (torch's rule for its own ``unscale_``).
    """
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError(
                    "Attempting to unscale FP16 gradients with allow_fp16=False; pass allow_fp16=True "
                    "(mixprec's unscale_ does: it unscales fp16 gradients in fp32 math)"
                )
            if grad.is_sparse:
                # Coalescing sums duplicate indices; in fp16 that can overflow, so check the result.
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grads.append(grad._values())
            else:
                grads.append(grad)
    return grads


def unscale_and_check(
    grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Unscale in place and flag inf/NaN with torch's fused kernel, one call per device and dtype.

    The flags go into a copy of ``found_inf`` per device (torch's ``_unscale_grads_`` does the same).
    fp16 and bf16 gradients are unscaled too: the kernel computes in fp32 and rounds once.
    """
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for grad in grads:
        groups[grad.device][grad.dtype].append(grad)
    found_per_device: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, by_dtype in groups.items():
            found = found_per_device[device] = found_inf.to(device=device, non_blocking=True, copy=True)
            device_inv = inv_scale.to(device=device, non_blocking=True, copy=True)
            for same_dtype in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, device_inv)
    return found_per_device


def agree(found_per_device: dict[torch.device, torch.Tensor], process_group: Any) -> dict[torch.device, torch.Tensor]:
    """Sum the inf/NaN flags over ``process_group`` in place, so every rank skips or steps together
    (torch's ShardedGradScaler does the same); ``None`` leaves them. Queues the all-reduce, no host sync."""
    if process_group is not None:
        import torch.distributed as dist

        for found in found_per_device.values():
            dist.all_reduce(found, op=dist.ReduceOp.SUM, group=process_group)
    return found_per_device


def summed(found_per_device: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The flags of every device summed on ``device``; ``None`` when there are none. No sync."""
    found = None
    for flag in found_per_device.values():
        flag = flag.to(device, non_blocking=True)
        found = flag if found is None else found + flag
    return found


# ----- MegEngine's manual style: unscale(params) -------------------------------------------


def manual_sources(params: torch.optim.Optimizer | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``unscale(params)`` works on: an optimizer's parameters, or those given.

    Raises:
        TypeError: an item that is not a tensor.
    """
    if isinstance(params, torch.optim.Optimizer):
        return [p for group in params.param_groups for p in group["params"]]
    if isinstance(params, torch.Tensor):
        return [params]
    items = list(params)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"unscale() takes an optimizer, parameters or gradient tensors, got {type(item).__name__}")
    return items


def first_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device of the first gradient among ``tensors`` (parameters or gradients); CPU if none."""
    for tensor in tensors:
        grad = tensor.grad if tensor.requires_grad and tensor.is_leaf else tensor
        if grad is not None:
            return grad.device
    return torch.device("cpu")


def unscale_manually(
    sources: list[torch.Tensor], scale: torch.Tensor, process_group: Any
) -> tuple[torch.Tensor, bool, int]:
    """Unscale the gradients of ``sources`` (parameters' ``.grad``, or gradient tensors) in place;
    when any holds inf/NaN on any rank, set every parameter's ``.grad`` to ``None`` so a following
    ``optimizer.step()`` changes nothing. Returns the summed inf/NaN flag, whether it is set, and
    how many gradients were dropped. Syncs once, to read the flag."""
    owners: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for tensor in sources:
        if tensor.requires_grad and tensor.is_leaf:
            if tensor.grad is not None:
                owners.append(tensor)
                grads.append(tensor.grad)
        else:
            grads.append(tensor)
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    found_per_device = agree(unscale_and_check(grads, inverse(scale), found_inf), process_group)
    found = sum(found_per_device.values(), torch.zeros((), device=scale.device))
    overflow = bool(found.item())
    if not overflow:
        return found, False, 0
    for owner in owners:
        owner.grad = None
    return found, True, len(owners)
