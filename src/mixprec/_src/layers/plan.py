"""Per-layer planning: measure each GEMM layer in each precision, choose one per layer.

:func:`measure` runs the model once in fp32 on the user's batch to capture each layer's input and
output gradient, then times, at those shapes, the layer's forward and backward (its output GEMM
and both gradient GEMMs) in each candidate precision and measures its error against fp32 from
the same weights, input and output gradient (SQNR of the output and both gradients; the worst
counts). fp16 is measured as it trains, behind a GradScaler: its output gradient is multiplied by
the loss scale a GradScaler trains this model at (:func:`settled_loss_scale`) and its gradients
divided by it after, so gradients fp16 holds only scaled are not counted as underflow.
``choice.choose`` picks per layer::

    allowed  = fp32, and each precision whose SQNR >= the floor
    fp8 only where the device has fp8 GEMMs, and never where it measured slower than bf16
    choice   = what the recipe gives the layer (its dtype, or fp32 where it keeps the layer) if allowed
               and within min_speedup of the fastest allowed, else the fastest allowed
    but      a block-scaled format asked for (nvfp4, mxfp8: emulated, never timed) whose SQNR >= the floor,
               the least precise such, before all of these

Candidates train one at a time, alternating precisions within each repetition so a shared
machine's load falls on all alike. A layer's noise is how far its fastest two runs of a precision
differ (:func:`timing.fastest_noise`, the worst precision's); a noisy layer is repeated (up to
``_MAX_REPS``), and another precision must beat the recipe's by that noise as well as by
``min_speedup`` (the reason says when the noise decided). Everything here syncs with the device:
it times GEMMs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src import _compat, input_checks, timing
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8.config import Fp8Config
from mixprec._src.gemms import flops, kinds, sites
from mixprec._src.layers.choice import Measured
from mixprec._src.layers.precision import (
    LayerPrecision,
    parse_precision,
    set_layer_precision,
)
from mixprec._src.numerics import sqnr

__all__ = ["FP8_CANDIDATES", "device_has_fp8", "measure", "settled_loss_scale"]


def __getattr__(name: str) -> Any:
    return _compat.forward("layers.plan", name)  # names older pickles hold


#: The fp8 recipes the planner considers (delayed scaling needs prepare's step hook: a whole-model choice).
FP8_CANDIDATES = (LayerPrecision.FP8_TENSORWISE, LayerPrecision.FP8_ROWWISE)
_REPS = 3  # timed repetitions per layer and precision (after one warm-up): the fastest counts
_MAX_REPS = 8  # ... repeated up to this many while the fastest two of a precision differ by over timing.NOISY
# An untimed (emulated) fp8 run of a layer past this many times its fp32 run is not the emulation the SQNR table
# is for (ATen's is about 2x fp32: quantize, then an fp32 GEMM); one such GEMM can outlast the whole budget.
_SLOW_EMULATION = 50.0
_SLOW_FLOOR_S = 0.1  # ... and past this (a tiny layer's fp32 run is all overhead)
_SLOW_REASON = "fp8 GEMMs emulated too slowly here for their SQNR"


@dataclasses.dataclass
class _Captured:
    module: nn.Module
    x: torch.Tensor
    x_needs_grad: bool
    grad: torch.Tensor


def device_has_fp8(device: torch.device) -> bool:
    """Whether ``device`` runs fp8 GEMMs in hardware (CUDA capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def settled_loss_scale(largest_gradient: float, init_scale: float = 2.0**16) -> float:
    """The loss scale a GradScaler starting at ``init_scale`` trains at when a step's largest gradient (in fp32)
    is ``largest_gradient``.

    The scaler halves the scale on every overflowing step, so within a few steps it is at most the
    largest power of two that keeps the largest gradient finite in fp16, ``2**floor(log2(65504 /
    largest_gradient))``; it grows past ``init_scale`` only one doubling per 2000 good steps, so not above it.
    """
    if not (largest_gradient > 0 and math.isfinite(largest_gradient)):
        return init_scale
    exponent = math.floor(math.log2(torch.finfo(torch.float16).max / largest_gradient))
    return min(2.0 ** max(exponent, -24), init_scale)


def _capture(
    model: nn.Module, batch: Any, loss_of: Callable[[Any], torch.Tensor]
) -> tuple[dict[str, _Captured], float, str]:
    """Each layer's first input and output gradient, from one fp32 forward and backward of a copy, the
    largest gradient of the step (the layers' output gradients and the parameters' gradients), and a note
    on the share of the forward's weight-GEMM FLOPs the layers hold."""
    copied = copy.deepcopy(model)
    found: dict[str, _Captured] = {}
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            x = args[0] if args else None
            if name in found or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
                return
            if not out.requires_grad:
                return
            entry = _Captured(module, x.detach().clone(), x.requires_grad, torch.empty(0))
            found[name] = entry

            def keep(grad: torch.Tensor) -> None:
                entry.grad = grad.detach().clone()

            out.register_hook(keep)  # type: ignore[no-untyped-call]

        return record

    layers = {name: module for name, module, _ in sites.gemm_layers(copied) if name}
    for name, module in layers.items():
        handles.append(module.register_forward_hook(hook(name)))
    losses: list[torch.Tensor] = []
    try:
        counted = flops.count(copied, layers, lambda: losses.append(loss_of(input_checks.call_model(copied, batch))))
        losses[0].backward()  # type: ignore[no-untyped-call]
    finally:
        for handle in handles:
            handle.remove()
    reach = _reach_note(counted, dict(sites.left_out(copied)))
    grads = [c.grad for c in found.values() if c.grad.numel()]
    grads += [p.grad for p in copied.parameters() if p.grad is not None and p.grad.numel()]
    largest = max((float(g.detach().abs().max()) for g in grads), default=0.0)
    return {n: c for n, c in found.items() if c.grad.numel()}, largest, reach


def _reach_note(counted: flops.Count, left_out: Mapping[str, str]) -> str:
    """The plan's reach: its layers' share of the forward's weight-GEMM FLOPs, and what holds the rest."""
    total = counted.weight_total
    share = sum(counted.layers.values()) / total if total else 1.0
    note = f"per-layer plan: its layers hold {share:.1%} of the forward's weight-GEMM FLOPs"
    rest = [
        f"{where or '<model>'} ({f / total:.1%}: {left_out.get(where, 'not a GEMM layer')})"
        for where, f in counted.weights.most_common()
    ]
    return note + ("; not layers: " + "; ".join(rest) if rest else "")


def _shape(module: nn.Module, x: torch.Tensor) -> str:
    kind = kinds.kind_of(module)
    if kind is not None and kind.linear:
        inp, out = kinds.features(module)
        rows = kinds.patches(module, x) if kind is kinds.PATCH else x
        return f"{kind} {inp}->{out}, {rows.numel() // max(rows.shape[-1], 1)} rows"
    conv: Any = module
    kernel = "x".join(str(k) for k in conv.kernel_size)
    return f"{type(module).__name__.lower()} {conv.in_channels}->{conv.out_channels} k{kernel}, input {tuple(x.shape)}"


class _Run:
    """One layer in one precision: a copy of it, run forward and backward on the captured tensors."""

    def __init__(self, captured: _Captured, precision: str, loss_scale: float = 1.0) -> None:
        self.holder = nn.Module()
        self.holder.layer = copy.deepcopy(captured.module)
        if precision is not LayerPrecision.FP32:
            set_layer_precision(self.holder, "layer", precision)
        self.captured = captured
        self.loss_scale = loss_scale  # a power of two: scaling and unscaling are exact but for range
        self.grad = captured.grad * loss_scale if loss_scale != 1.0 else captured.grad
        self.times: list[float] = []
        self.result: tuple[torch.Tensor, ...] = ()

    def __call__(self) -> float:
        c = self.captured
        layer: Any = self.holder.layer
        layer.zero_grad(set_to_none=True)
        for param in (kinds.weight_of(layer), kinds.bias_of(layer)):  # an in-projection's are its owner's
            if param is not None:
                param.grad = None
        x = c.x.clone().requires_grad_(c.x_needs_grad)
        device = x.device
        timing.sync(device)
        begin = timing.clock()
        out = layer(x)
        out.backward(self.grad.to(out.dtype))
        timing.sync(device)
        seconds = timing.clock() - begin
        weight: Any = layer.weight
        grads = (weight.grad, *((x.grad,) if c.x_needs_grad else ()))
        unscale = 1.0 / self.loss_scale
        self.result = (out.detach().float(), *(g.float() * unscale for g in grads if g is not None))
        self.times.append(seconds)
        return seconds


def _fp8_reason(module: nn.Module, name: str, head: str | None) -> str | None:
    """Why fp8 cannot take this layer (the rules of prepare's fp8 conversion), or None."""
    return fp8_conversion.reason_to_skip(module, name, Fp8Config(), False, head)


def measure(
    model: nn.Module,
    batch: Any,
    loss_of: Callable[[Any], torch.Tensor],
    precisions: Sequence[str],
    deadline: float,
    emulated: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Measured], list[str]]:
    """Time and check each layer of ``model`` in each of ``precisions`` (fp32 always), until ``deadline``.

    fp8 precisions are measured on devices with fp8 GEMMs only (elsewhere ``torch._scaled_mm`` is an
    fp32 emulation whose speed means nothing), for the layers prepare's fp8 conversion would take.
    ``emulated``: dtypes this device emulates, with how many times slower than fp32 their matmuls
    are; they are not run (a layer would take that many times fp32's time) and the plan says so.

    Returns:
        the layers measured, in the order the forward called them, and notes (sentences).
    """
    device = next(model.parameters()).device
    notes: list[str] = []
    wanted = list(dict.fromkeys([LayerPrecision.FP32, *(parse_precision(p) for p in precisions)]))
    # run once for their SQNR (the emulation computes what the hardware would), not timed
    untimed = {p for p in wanted if p.block}
    if untimed:
        block = ", ".join(p.value for p in sorted(untimed, key=lambda p: p.rung))
        notes.append(
            f"per-layer plan: {block} chosen by SQNR alone: block-scaled GEMMs are emulated "
            "(blocks dequantized, an fp32 GEMM), so their time here is not the hardware's and was not measured"
        )
    if any(p.fp8_recipe and not p.block for p in wanted) and not device_has_fp8(device):
        untimed |= {p for p in wanted if p.fp8_recipe}
        notes.append(
            f"no layer in fp8: fp8 GEMMs are emulated on {device.type} (torch._scaled_mm in fp32), "
            "so fp8 could only be slower; a GPU of compute capability 8.9+ has them (the table "
            "shows fp8's SQNR per layer, the same there)"
        )
    slow = {parse_precision(p): s for p, s in (emulated or {}).items() if p in wanted and p != LayerPrecision.FP32}
    if slow:
        wanted = [p for p in wanted if p not in slow]
        notes.append(
            "per-layer plan: not run in "
            + ", ".join(f"{p} (a matmul {s:.0f}x slower than fp32: emulated)" for p, s in slow.items())
        )
    captured, largest_gradient, reach = _capture(model, batch, loss_of)
    notes.append(reach)
    fp16_scale = settled_loss_scale(largest_gradient)
    if LayerPrecision.FP16 in wanted:
        notes.append(
            f"per-layer plan: fp16 measured behind a loss scale of 2**{int(math.log2(fp16_scale))}, what "
            f"a GradScaler trains this model at (largest gradient {largest_gradient:.3g})"
        )
    head = fp8_conversion.head_of(model, sites.gemm_layers(model, route=False))
    out: list[Measured] = []
    dropped: set[LayerPrecision] = set()  # untimed precisions whose emulation here is too slow to run for its SQNR
    for name, c in captured.items():
        if time.perf_counter() > deadline:
            notes.append(
                f"the budget ran out after {len(out)} of {len(captured)} layers: the others keep the recipe's dtype"
            )
            break
        entry = Measured(
            name,
            _shape(c.module, c.x),
            {},
            {},
            {p: f"emulated here (a matmul {s:.0f}x slower than fp32)" for p, s in slow.items()},
        )
        runs: dict[LayerPrecision, _Run] = {}
        for p in wanted:
            why = _fp8_reason(c.module, name, head) if p.fp8_recipe else None
            if why is not None:
                entry.not_measured[p] = why.split(" (")[0].split(", which")[0]  # the rule, without its advice
                continue
            if p in dropped:
                entry.not_measured[p] = _SLOW_REASON
                continue
            runs[p] = _Run(c, p, fp16_scale if p is LayerPrecision.FP16 else 1.0)
        if progress is not None:
            progress(f"  layer {name} ({entry.shape}): {', '.join(runs)}")
        for p, run in list(runs.items()):
            if p in dropped:  # this layer's earlier fp8 run was the slow one
                del runs[p]
                entry.not_measured[p] = _SLOW_REASON
                continue
            seconds = run()  # warm-up
            if p in untimed and seconds > max(_SLOW_EMULATION * runs[LayerPrecision.FP32].times[0], _SLOW_FLOOR_S):
                dropped |= untimed
                ratio = seconds / runs[LayerPrecision.FP32].times[0]
                notes.append(
                    f"per-layer plan: fp8's SQNR not measured from layer {name} on: its {p} GEMMs took "
                    f"{seconds:.2g} s, {ratio:.0f}x its fp32 run (the emulation is about 2x), and one "
                    "such GEMM of a larger layer could take the whole budget"
                )
        timed = {p: run for p, run in runs.items() if p not in untimed}
        rep = 0
        while rep < _REPS or (rep < _MAX_REPS and _noise(timed) > timing.NOISY and time.perf_counter() < deadline):
            order = list(timed.values()) if rep % 2 == 0 else list(reversed(timed.values()))
            for run in order:
                if time.perf_counter() < deadline:
                    run()
            rep += 1
        entry.noise = _noise(timed)
        reference = runs[LayerPrecision.FP32].result
        for p, run in runs.items():
            if p in untimed:
                entry.not_measured[p] = (
                    "block-scaled GEMMs emulated" if p.block else f"fp8 GEMMs emulated on {c.x.device.type}"
                )
            else:
                entry.ms[p] = min(run.times[1:] or run.times) * 1e3  # a shared machine's load only adds time
            if p is not LayerPrecision.FP32:
                entry.sqnr_db[p] = min(sqnr(a, b) for a, b in zip(run.result, reference, strict=True))
        out.append(entry)
    return out, notes


def _noise(runs: Mapping[LayerPrecision, _Run]) -> float:
    """The worst precision's :func:`timing.fastest_noise` over its timed runs (after the warm-up)."""
    return max((n for run in runs.values() if (n := timing.fastest_noise(run.times[1:])) is not None), default=0.0)
