"""Count a forward's GEMM FLOPs and who ran them: each GEMM layer, other modules' weights, activations.

:func:`count` runs a callable once under a dispatch mode that sees every matrix product and
convolution (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``, convolutions, fused
attention) and charges its FLOPs to the innermost GEMM layer running (a layer's fp8 GEMM counts
as its own), or, outside every layer, to the innermost module, as a *weight* GEMM where one operand
is a parameter or a cast, view or copy of one, else as an *activation* GEMM (attention's scores
and values). FLOPs are counted from shapes (``2 * m * k * n`` a product), as
``torch.utils.flop_counter`` counts them. It runs what it is given (a forward syncs as it does).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["Count", "count"]

_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
}
#: Ops whose output is the same values as their one tensor input, reshaped, cast or copied.
_SAME_VALUES = {
    "_to_copy",
    "clone",
    "t",
    "transpose",
    "permute",
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "contiguous",
    "detach",
    "alias",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "as_strided",
    "_reshape_alias",
    "lift_fresh",
    "numpy_T",
}


@dataclasses.dataclass
class Count:
    """GEMM FLOPs of one forward.

    Attributes:
        layers: per GEMM layer (by name), its FLOPs.
        calls: per GEMM layer, how many times it was called.
        weights: per module outside every layer (by name), FLOPs of GEMMs with a weight.
        activations: per module, FLOPs of GEMMs between activations (no weight).
    """

    layers: Counter[str] = dataclasses.field(default_factory=Counter)
    calls: Counter[str] = dataclasses.field(default_factory=Counter)
    weights: Counter[str] = dataclasses.field(default_factory=Counter)
    activations: Counter[str] = dataclasses.field(default_factory=Counter)

    @property
    def weight_total(self) -> int:
        """FLOPs of every GEMM with a weight (layers' and others')."""
        return sum(self.layers.values()) + sum(self.weights.values())


def _attention_flops(args: tuple[Any, ...]) -> int:
    q, k = args[0], args[1]
    *batch, length, dim = q.shape
    b = 1
    for n in batch:
        b *= int(n)
    return 4 * b * int(length) * int(k.shape[-2]) * int(dim)


class _Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, params: Iterable[torch.Tensor], stack: list[tuple[str, bool]], result: Count) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.derived = {p.untyped_storage().data_ptr() for p in params if p.device.type != "meta"}
        self.stack, self.result = stack, result

    def _is_weight(self, tensors: list[torch.Tensor]) -> bool:
        return any(t.untyped_storage().data_ptr() in self.derived for t in tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = packet.__name__
        tensors = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.layout == torch.strided
        ]
        flops = 0
        if name in _ATTENTION:
            flops = _attention_flops(args)
        elif packet in flop_registry and not name.endswith("_backward"):
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        if flops:
            layer = next((n for n, is_layer in reversed(self.stack) if is_layer), None)
            where = self.stack[-1][0] if self.stack else ""
            if layer is not None:
                self.result.layers[layer] += flops
            elif self._is_weight(tensors):
                self.result.weights[where] += flops
            else:
                self.result.activations[where] += flops
        elif name in _SAME_VALUES and len(tensors) == 1 and self._is_weight(tensors):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    self.derived.add(t.untyped_storage().data_ptr())
        return out


def count(model: nn.Module, layer_names: Iterable[str], run: Callable[[], Any]) -> Count:
    """Run ``run()`` once (a forward of ``model``) and count its GEMM FLOPs by layer and module.

    ``layer_names``: the names of ``model``'s GEMM layers (``model.named_modules()``'s).
    """
    layers = set(layer_names)
    stack: list[tuple[str, bool]] = []
    result = Count()
    handles = []
    for name, module in model.named_modules():

        def enter(module: nn.Module, args: Any, name: str = name) -> None:
            stack.append((name, name in layers))
            if name in layers:
                result.calls[name] += 1

        def leave(module: nn.Module, args: Any, out: Any, name: str = name) -> None:
            while stack and stack.pop()[0] != name:
                pass

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with _Counter([p for p in model.parameters()], stack, result):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return result
