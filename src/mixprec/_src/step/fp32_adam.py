"""torch's own Adam(W) step of the fp32 weights, in one call a param group on the CPU: :func:`install`.

What the levels leave to the optimizer's own step (every weight at O1 and O2's fp32 masters, the norms kept in fp32
at the bf16 levels, whatever a state precision leaves) torch's for-loop and foreach Adam(W) step with several
ATen ops a weight on the CPU: their step grows with the model. Here those fp32 weights take one call of
``optim.fp32_lists.step_list`` a param group and step count instead, bit for bit torch's step (the kernel computes
each op as ATen does, MKL's square root included; a probe checks it where it runs, and where it does not match
torch's own step runs). Installed outermost on Adam(W)'s ``_init_group``: whatever the other stages handed on
to torch's step (the lists ``_init_group`` fills) is taken from the lists, stepped, and counted, and torch's
step gets what is left. The fused form keeps torch's fused kernel (one call a group already; its arithmetic
is its own). Nothing here syncs: step counts are counted on the host.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from mixprec._src.optim import fp32_lists
from mixprec._src.step.host_counts import HostCounts
from mixprec._src.step.stochastic_rounding import Restore

__all__ = ["install", "takes_group"]


def takes_group(group: dict[str, Any]) -> bool:
    """Whether torch steps ``group`` with its for-loop or foreach Adam(W) arithmetic, which the kernel has: not
    fused, capturable, differentiable or amsgrad."""
    return not (group.get("fused") or group.get("capturable") or group.get("differentiable") or group.get("amsgrad"))


def install(optimizer: torch.optim.Optimizer, handles: list[Any]) -> None:
    """Step the fp32 CPU weights torch's Adam(W) would step one by one in one call a param group (see the module)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    if not any(p.is_cpu for g in optimizer.param_groups for p in g["params"]):
        return
    inner = optimizer.__dict__.get("_init_group")  # another stage's, or None: the class's own
    collect = inner if inner is not None else types.MethodType(type(optimizer)._init_group, optimizer)  # type: ignore[attr-defined]
    counts = HostCounts()

    def _init_group(self: torch.optim.Optimizer, group: dict[str, Any], *lists: list[torch.Tensor]) -> Any:
        has_complex = collect(group, *lists)
        params, grads, exp_avgs, exp_avg_sqs, _, state_steps = lists
        if not params or not takes_group(group) or torch.compiler.is_compiling() or not fp32_lists.available():
            return has_complex
        taken: list[int] = []
        left: list[int] = []
        for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True)):
            mine = fp32_lists.takes(p, g, m, v) and t.dtype is torch.float32 and t.is_cpu and t.dim() == 0
            (taken if mine else left).append(i)
        if not taken:
            return has_complex
        chosen = [params[i] for i in taken]
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))
        by_count: dict[float, list[tuple[torch.Tensor, ...]]] = {}
        for i, count in zip(taken, counts.advance(chosen, [self.state[p] for p in chosen]), strict=True):
            by_count.setdefault(count, []).append((params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))
        with torch.no_grad():
            for count, rows in by_count.items():
                fp32_lists.step_list(rows, group, count, decoupled)  # type: ignore[arg-type]
        for held in (params, grads, exp_avgs, exp_avg_sqs, state_steps):  # torch's step gets the rest
            held[:] = [held[i] for i in left]
        return has_complex

    optimizer._init_group = types.MethodType(_init_group, optimizer)  # type: ignore[attr-defined]
    handles.append(Restore(optimizer, "_init_group"))  # as every stage's: the class's own back
