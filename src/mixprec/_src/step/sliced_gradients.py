"""Large weights' gradients made and stepped a slice of rows at a time, in backward (``step_in_backward=True``).

With the step in backward a parameter's gradient lives from the moment backward makes it until its
parameter is stepped, so the most gradient memory alive at once is the largest weight's gradient (the
bench transformer's 4096x1024 feed-forward weights: a third of a byte per parameter of the whole model).
Where the optimizer keeps a weight's Adam(W) moments quantized (``optimizer_state`` ``"8bit"``, ``"4bit"``,
``"fp8"``), a GEMM layer (``nn.Linear``, an attention's packed in-projection, transformers' ``Conv1D``)
whose weight holds at least ``2 * SLICE`` values computes through :class:`_Gemm`, whose backward

1. computes the input's gradient (with the weight as the forward used it) and the bias's,
2. then the weight's gradient :data:`SLICE` values at a time (whole rows of the weight, whole blocks of
   its quantized moments), each slice counted into the clipping norm, stepped as soon as it is made
   (``low_bit_state.slice_stepper``: those values' step, as the whole gradient's step takes it) and dropped.

The numbers: each slice is one GEMM over the whole batch, the rows of the whole gradient's GEMM (the same
sums, bitwise the whole GEMM's on the CPUs tested; a BLAS may order a sum by the shape it is given), and
the input's and bias's gradients are autograd's. With clipping, each slice is counted into the norm seen
so far as it comes (a spike is clipped from the slice that shows it on), not once per weight.

It does not apply, and the layer computes as before (its gradient whole, stepped by the parameter's hook),
where the layer has a forward of its own (fp8, a per-layer precision), where its weight is shared with
another module, sharded by FSDP2 (FSDP2 reduce-scatters whole gradients), frozen, or not stepped with
quantized Adam(W) state, in O2 (the optimizer steps fp32 masters), and under ``torch.compile``. A layer
called more than once per backward (a block shared across depth) keeps the gradients of its other calls
and steps their sum at the last call's backward; a call whose graph is dropped without a backward leaves
that layer's gradient whole, stepped at ``optimizer.step()`` (a warning says so once). Nothing here syncs.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from mixprec._src import sharding
from mixprec._src.gemms import attention, kinds, sites
from mixprec._src.step import low_bit_state
from mixprec._src.step.stochastic_rounding import fixed_positions

__all__ = ["SLICE", "alive", "install", "is_sliced", "slice_rows", "sliceable_weights"]

#: values of a weight's gradient made at once (2 MiB in bf16): ~1.5% of a 4096x1024 layer's backward here
SLICE = 1 << 20
_KINDS = (kinds.LINEAR, kinds.ATTENTION_IN, kinds.CONV1D)
_LAYERS: weakref.WeakKeyDictionary[nn.Module, _Layer] = weakref.WeakKeyDictionary()


def slice_rows(weight_shape: tuple[int, ...], block: int) -> int:
    """Rows of a weight of ``weight_shape`` (as stored) in one slice: about :data:`SLICE` values, a whole
    number of ``block``-value blocks."""
    cols = math.prod(weight_shape[1:])
    unit = block // math.gcd(cols, block)  # rows that make whole blocks
    return max(unit, SLICE // cols // unit * unit)


def sliceable_weights(model: nn.Module, route: bool = True) -> dict[int, tuple[nn.Module | None, torch.Tensor]]:
    """id(weight) -> (its GEMM layer, the weight) for each layer whose weight could be made a slice at a time:
    a linear-kind layer with its class's forward, its weight a whole parameter of ``2 * SLICE`` values or more,
    held by no other module (the optimizer and its state decide the rest: :func:`install`). ``route``: route
    the model's attentions first (prepare does); without it, the projections of the attentions prepare would
    route are counted too, with no layer (planning, before prepare)."""
    holders: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        holders[id(param)] = holders.get(id(param), 0) + 1
    candidates: list[tuple[nn.Module | None, torch.Tensor]] = [
        (module, kinds.weight_of(module))
        for _, module, kind in sites.gemm_layers(model, route)
        if kind in _KINDS and "forward" not in module.__dict__
    ]
    if not route:
        for _, owner in attention.attentions(model):
            routable = attention.unroutable(owner) is None and "forward" not in owner.__dict__
            if routable and not attention.is_routed(owner):
                candidates.append((None, owner.in_proj_weight))
                if "forward" not in owner.out_proj.__dict__:
                    candidates.append((None, owner.out_proj.weight))
    found: dict[int, tuple[nn.Module | None, torch.Tensor]] = {}
    for module, weight in candidates:
        if not isinstance(weight, nn.Parameter) or sharding.is_sharded(weight) or holders.get(id(weight)) != 1:
            continue
        if weight.numel() >= 2 * SLICE and weight.requires_grad:
            found[id(weight)] = (module, weight)
    return found


def alive(weight: torch.Tensor, block: int) -> int:
    """Values of ``weight``'s gradient alive at once where it is made a slice at a time."""
    return min(weight.numel(), slice_rows(tuple(weight.shape), block) * math.prod(weight.shape[1:]))


def install(model: nn.Module, optimizer: torch.optim.Optimizer, stepper: Any, handles: list[Any]) -> list[nn.Module]:
    """Make the weight gradients of ``model``'s large GEMM layers a slice at a time in backward (see the
    module); returns the layers it applies to."""
    layers = []
    for module, weight in sliceable_weights(model).values():
        block = low_bit_state.sliced(optimizer, weight)
        if not block or module is None:
            continue
        layer = _Layer(module, weight, optimizer, stepper, slice_rows(tuple(weight.shape), block))
        _LAYERS[module] = layer
        module.forward = _SlicedForward(module)  # type: ignore[method-assign]
        handles.append(_Unbind(module))
        layers.append(module)
    if layers:  # before the optimizer's own step, as the step in backward comes before it
        handles.append(optimizer.register_step_pre_hook(lambda *_: _finish(layers)))
    return layers


def _finish(modules: list[nn.Module]) -> None:
    for module in modules:
        layer = _LAYERS.get(module)
        if layer is not None:
            layer.finish()


def is_sliced(module: nn.Module) -> bool:
    """Whether ``module``'s weight gradient is made and stepped a slice at a time."""
    return isinstance(module.__dict__.get("forward"), _SlicedForward) and module in _LAYERS


class _SlicedForward:
    """A sliced layer's forward: :class:`_Gemm` where a backward will follow, the class's own forward else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        # compiled, the gradient stays whole (the parameter's hook steps it); the registry is not read in a graph
        layer = None if torch.compiler.is_compiling() else _LAYERS.get(module)
        if layer is None or not torch.is_grad_enabled() or not layer.weight.requires_grad:
            return type(module).forward(module, x)  # type: ignore[no-any-return]
        return layer(x)

    def __reduce__(self) -> tuple[Any, ...]:  # loaded, it is no layer's here: the class's forward
        return _SlicedForward, (self.module,)


class _Unbind:
    """A handle whose remove() gives the layer its class's forward back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        if isinstance(self.module.__dict__.get("forward"), _SlicedForward):
            del self.module.__dict__["forward"]
        _LAYERS.pop(self.module, None)


class _Layer:
    """One sliced layer: its weight, the optimizer that steps it, and its calls awaiting a backward."""

    def __init__(
        self, module: nn.Module, weight: torch.Tensor, optimizer: torch.optim.Optimizer, stepper: Any, rows: int
    ) -> None:
        self.module, self.weight, self.optimizer, self.stepper, self.rows = module, weight, optimizer, stepper, rows
        self.transposed = kinds.kind_of(module) is kinds.CONV1D  # weight stored (in, out)
        self.pending = 0  # calls in a graph whose backward has not come, this step
        self.kept: torch.Tensor | None = None  # the gradient of calls whose backward came before the last's
        self.told = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from mixprec._src.fp8.linear import compute_dtype  # the dtype nn.Linear computes in here

        dtype = compute_dtype(x)
        bias = kinds.bias_of(self.module)
        x = x.to(dtype)  # autocast's casts, as autograd records them
        bias = None if bias is None else bias.to(dtype)
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward (activation checkpointing)
            self.pending += 1
        with torch.autocast(x.device.type, enabled=False):
            out: torch.Tensor = _Gemm.apply(x, self.weight, bias, self)  # type: ignore[no-untyped-call]
        return out

    def backward(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        """Make the weight's gradient from the layer's output gradient and input (2-D) and step it."""
        weight = self.weight
        self.pending -= 1
        if self.pending > 0:  # another call's backward is still to come: this one's gradient is kept for it
            whole = self._slice(grad, x, slice(None))
            self.kept = whole if self.kept is None else self.kept + whole
            return
        stepper, optimizer = self.stepper, self.optimizer
        stepper.flush()  # the gradients held before this one are stepped first (their norms summed first)
        group = stepper.begin(weight)
        cols = math.prod(weight.shape[1:])
        with torch.no_grad(), fixed_positions(optimizer):
            step = low_bit_state.slice_stepper(optimizer, weight, group)
            for first in range(0, weight.shape[0], self.rows):
                rows = slice(first, first + self.rows)
                part = self._slice(grad, x, rows)
                if self.kept is not None:
                    part = self.kept[rows] + part
                scale = stepper.add_norm([part])
                if scale is not None:
                    part.mul_(scale.to(part.device))
                step(part, first * cols)
                del part
            low_bit_state.count_step(optimizer, weight)
        self.kept = None
        stepper.stepped.add(id(weight))

    def _slice(self, grad: torch.Tensor, x: torch.Tensor, rows: slice) -> torch.Tensor:
        part = x[:, rows].t().mm(grad) if self.transposed else grad[:, rows].t().mm(x)
        return part.to(self.weight.dtype).view(-1, *self.weight.shape[1:])

    def finish(self) -> None:
        """At ``optimizer.step()``: a gradient kept for a backward that never came is stepped now, whole."""
        kept, self.kept, self.pending = self.kept, None, 0
        if kept is None:
            return
        if not self.told:
            self.told = True
            warnings.warn(
                f"a {type(self.module).__name__}'s weight gradient waited for the backward of a call whose "
                "graph was dropped (a forward with gradients on and no backward, e.g. an evaluation "
                "outside torch.no_grad()): it was stepped whole at optimizer.step(), not a slice at a time "
                "in backward",
                UserWarning,
                stacklevel=4,
            )
        self.weight.grad = kept
        self.stepper.step([self.weight])


class _Gemm(torch.autograd.Function):
    """``kinds.compute``'s GEMM whose backward steps the weight a slice at a time (see the module)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: _Layer) -> Any:
        w = weight.to(x.dtype)
        ctx.layer = layer
        ctx.save_for_backward(x, w)
        return kinds.compute(layer.module, x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        layer: _Layer = ctx.layer
        grad2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:  # with the weight as the forward used it, before its step
            grad_x = (grad2.mm(w.t()) if layer.transposed else grad2.mm(w)).view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_bias = grad2.sum(0)
        layer.backward(grad2, x2)
        return grad_x, None, grad_bias, None
