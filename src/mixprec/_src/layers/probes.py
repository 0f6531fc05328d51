"""The guard's probes: identity autograd Functions around each watched layer that fold what they see into a
statistics tensor, in place.

Per layer and step, a row of columns (``IN`` to ``KIND``): amaxes of the input, output, output gradient and
input gradient (max over the layer's calls), whether a call made inf/NaN from finite values in
forward or backward, the weight gradient's finiteness, fp8 cast fractions, and what the layer
computed in (a code of ``KINDS``). The probes are functions of tensors only, so under
``torch.compile`` Dynamo traces them into the model's graph (forward and backward) with no graph
break; a call's two probes talk through autograd (a token whose gradient says whether the call's
output gradient was finite), so each call pairs its own gradients. Nothing here syncs.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.layers.precision import PRECISIONS

__all__ = ["KINDS", "ProbeIn", "ProbeOut", "amax_of", "fold", "local_grad"]

# Columns of what a step records per layer: amaxes (max over the layer's calls), then per-call origin flags
# (1: some call of the layer made inf/NaN from finite values), then the weight gradient and fp8 columns.
IN, OUT, GRAD_OUT, GRAD_IN, FWD_ORIGIN, BWD_ORIGIN = range(6)
BAD_WEIGHT_GRAD, SATURATED, FLUSHED, KIND = range(6, 10)
# What a layer computed in, recorded in the graph as a code (1 + its index here; 0: not called this step).
KINDS = (*PRECISIONS, "fp64")
FP16_MAX = torch.finfo(torch.float16).max


def fold(stats: torch.Tensor, index: int, column: int, value: torch.Tensor) -> None:
    """``stats[index, column] = max(it, value)`` in place (a NaN stays: torch.maximum keeps it)."""
    with torch.no_grad():
        stats[index, column] = torch.maximum(stats[index, column], value.float())


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s largest magnitude in fp32; 0 for an empty tensor (folding 0 into a statistic changes nothing)."""
    return t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)


class ProbeIn(torch.autograd.Function):
    """Identity before a layer whose backward sees the layer's own input gradient (not the sum a shared
    input receives): its amax, and whether this call made it inf/NaN from a finite output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stats: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.stats = stats  # not saved for backward: the probes write it in place, so its version moves
        ctx.index = index
        return x.view_as(x), x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, finite_grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        stats, amax = ctx.stats, amax_of(grad)
        fold(stats, ctx.index, GRAD_IN, amax)
        # finite_grad_out: 1 where the call's output gradient was finite, 0 where not or never computed
        fold(stats, ctx.index, BWD_ORIGIN, (finite_grad_out > 0) & ~amax.isfinite())
        return grad, None, None


class ProbeOut(torch.autograd.Function):
    """Identity after a layer whose backward records the output gradient's amax and answers the token."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, token: torch.Tensor, stats: torch.Tensor, index: int) -> torch.Tensor:
        ctx.stats = stats  # not saved for backward: the probes write it in place, so its version moves
        ctx.index = index
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        amax = amax_of(grad)
        fold(ctx.stats, ctx.index, GRAD_OUT, amax)
        return grad, amax.isfinite().float(), None, None


def local_grad(weight: Any) -> torch.Tensor | None:
    """A weight's gradient as a plain tensor (FSDP2's is this rank's shard of a DTensor; the step all-reduces)."""
    grad = getattr(weight, "grad", None)
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad
