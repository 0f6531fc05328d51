"""The optimizer's own step (torch's Adam(W) and SGD) of what the other stages leave, in one call a param group on
the CPU: :func:`install`.

What the levels leave to the optimizer's own step (every weight at O1 and O2's fp32 masters, bf16-pure's bf16
weights, the norms kept in fp32 at the bf16 levels, whatever a state precision leaves) torch's for-loop and foreach
Adam(W) and SGD step with several ATen ops a weight on the CPU: their step grows with the model. Here those weights
(fp32; and bf16 ones with Adam(W), but for Adam's L2 decay) take one call of
``optim.aten_lists`` a param group (and step count) instead, bit for bit torch's step (the kernels compute each
op as ATen does, MKL's square root included; a probe checks them where they run, and where they do not match,
torch's own step runs). Installed outermost on the optimizer's ``_init_group``: whatever the other stages handed
on to torch's step (the lists ``_init_group`` fills) is taken from the lists, stepped, counted (Adam's step
counts; SGD's new momentum buffers put in its state, as its step puts them), and torch's step gets what is left.
The fused forms keep torch's fused kernels (one call a group already; their arithmetic is their own). Nothing
here syncs: step counts are counted on the host.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.optim import aten_lists
from mixprec._src.step.host_counts import HostCounts
from mixprec._src.step.stochastic_rounding import Restore

__all__ = ["install", "takes_group"]

_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def takes_group(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether torch steps ``group`` with its for-loop or foreach arithmetic, which the kernels have: Adam(W) or SGD,
    not fused, capturable, differentiable or amsgrad."""
    if type(optimizer) not in (*_ADAMS, torch.optim.SGD):
        return False
    return not (group.get("fused") or group.get("capturable") or group.get("differentiable") or group.get("amsgrad"))


def install(optimizer: torch.optim.Optimizer, handles: list[Any]) -> None:
    """Step the CPU weights torch's Adam(W) or SGD would step one by one in one call a param group (see the
    module)."""
    if not any(p.is_cpu for g in optimizer.param_groups for p in g["params"]):
        return
    if type(optimizer) in _ADAMS:
        take: Callable[..., None] = _AdamLists()
    elif type(optimizer) is torch.optim.SGD:
        take = _sgd_lists
    else:
        return
    inner = optimizer.__dict__.get("_init_group")  # another stage's (a method of this optimizer), or the class's own
    collect = inner.__func__ if inner is not None else type(optimizer)._init_group  # type: ignore[attr-defined]

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *lists: list[Any]) -> Any:
        found = collect(self, group, *lists)
        if lists[0] and takes_group(self, group) and not torch.compiler.is_compiling():
            take(self, group, *lists)
        return found

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))  # as every stage's: the class's own back


def _keep(lists: tuple[list[Any], ...], left: list[int]) -> None:
    for held in lists:  # torch's step gets the rest
        held[:] = [held[i] for i in left]


class _AdamLists:
    """Takes Adam(W)'s fp32 and bf16 weights out of the lists ``_init_group`` filled and steps them, a dtype and step
    count at a time."""

    def __init__(self) -> None:
        self.counts = HostCounts()

    def __call__(self, opt: torch.optim.Optimizer, group: dict[str, Any], *lists: list[torch.Tensor]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, _, state_steps = lists
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
        taken: list[int] = []
        left: list[int] = []
        for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True)):
            dtype = p.dtype
            mine = (
                aten_lists.takes(p, g, m, v, dtype=dtype)
                and t.dtype is torch.float32
                and t.is_cpu
                and t.dim() == 0
                and aten_lists.supports(group, dtype, decoupled)
                and aten_lists.available(dtype)
            )
            (taken if mine else left).append(i)
        if not taken:
            return
        chosen = [params[i] for i in taken]
        by_kind: dict[tuple[torch.dtype, float], list[tuple[torch.Tensor, ...]]] = {}
        for i, count in zip(taken, self.counts.advance(chosen, [opt.state[p] for p in chosen]), strict=True):
            by_kind.setdefault((params[i].dtype, count), []).append((params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))
        with torch.no_grad():
            for (_, count), rows in by_kind.items():
                aten_lists.step_list(rows, group, count, decoupled)  # type: ignore[arg-type]
        _keep((params, grads, exp_avgs, exp_avg_sqs, state_steps), left)


def _sgd_lists(opt: torch.optim.Optimizer, group: dict[str, Any], *lists: list[Any]) -> None:
    """Takes SGD's fp32 weights out of the lists ``_init_group`` filled and steps them; a momentum buffer made at a
    weight's first step goes in its state, as SGD's step puts it there."""
    params, grads, buffers = lists
    if not aten_lists.sgd_available():
        return
    momentum = float(group["momentum"]) != 0
    taken: list[int] = []
    left: list[int] = []
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        buffer = buffers[i] if momentum else None
        (taken if aten_lists.takes(p, g, *([] if buffer is None else [buffer])) else left).append(i)
    if not taken:
        return
    rows = []
    for i in taken:
        p, buffer = params[i], buffers[i] if momentum else None
        started = buffer is not None
        if momentum and buffer is None:
            buffer = opt.state[p]["momentum_buffer"] = torch.empty_like(p, memory_format=torch.contiguous_format)
        rows.append((p, grads[i], buffer, started))
    with torch.no_grad():
        aten_lists.sgd_step(rows, group)
    _keep((params, grads, *([buffers] if momentum else [])), left)
