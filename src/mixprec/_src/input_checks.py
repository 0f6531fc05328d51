"""What diagnose, tune and prepare share about a user's model, batch, loss and optimizer.

A model is called with a batch as ``model(**batch)`` (a dict), ``model(*batch)`` (a tuple or
list) or ``model(batch)``; its output becomes a scalar loss through ``loss_fn`` (or, without one,
the mean square of its floating outputs, for measuring numerics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "call_model",
    "check_inputs",
    "device_type_of",
    "holds_only_parameters_of",
    "LossFn",
    "scalar_loss",
    "with_targets",
]

LossFn = Callable[[Any], torch.Tensor]


def check_inputs(model: nn.Module, inputs: Any, loss_fn: LossFn | None) -> torch.device:
    """The model's device, after checking the inputs are on it and ``loss_fn`` is callable."""
    params = list(model.parameters())
    if not params:
        raise ValueError("diagnose needs a model with parameters: it compares low-precision weights against fp32")
    device = params[0].device
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"an input or target is on {t.device} but the model is on {device}; move them to {device}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn must be a callable taking the model's output and returning a scalar loss")
    return device


def scalar_loss(out: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The model output ``out`` as a 0-dim loss."""
    if loss_fn is not None:
        try:
            loss = loss_fn(out)
        except TypeError as exc:
            if isinstance(out, torch.Tensor):
                raise
            kind = type(out).__name__
            raise TypeError(
                f"{exc}: the model returns a {kind}, not a tensor, and loss_fn takes it as it comes; pass a loss "
                f"that picks the tensor, e.g. loss_fn=lambda out, y: F.cross_entropy(out.logits, y) with targets=y "
                f"(Hugging Face models return a ModelOutput), or loss_fn=lambda out: out.loss"
            ) from exc
    else:
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not tensors:
            raise ValueError("the model returned no floating tensor; pass loss_fn to turn its output into a loss")
        loss = sum(t.float().square().mean() for t in tensors)  # type: ignore[assignment]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean()) first")
    return loss.reshape(())


def with_targets(loss_fn: Callable[..., torch.Tensor], targets: Any, output: Any) -> torch.Tensor:
    """``loss_fn(output, targets)``: a two-argument loss bound to its targets (with functools.partial)."""
    return loss_fn(output, targets)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on a batch (see the module docstring)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        try:
            return model(*inputs)
        except TypeError as exc:
            if len(inputs) == 2 and "positional argument" in str(exc):
                raise TypeError(
                    f"{exc}: diagnose passes a tuple of inputs to the model as positional arguments; "
                    "for an (inputs, targets) batch call diagnose(model, inputs, loss_fn, "
                    "targets=targets), with loss_fn(output, targets)"
                ) from exc
            raise
    return model(inputs)


def device_type_of(model: nn.Module) -> str:
    """The device type of the model's first parameter (``"cpu"`` for a model without parameters)."""
    for p in model.parameters():
        return p.device.type
    return "cpu"


def holds_only_parameters_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether every tensor ``optimizer`` steps is a parameter of ``model`` (host-side, no sync)."""
    params = {id(p) for p in model.parameters()}
    return all(id(p) in params for group in optimizer.param_groups for p in group["params"])
