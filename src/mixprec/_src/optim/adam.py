"""Adam and AdamW with block-wise quantized moments: one parameter's step.

A parameter of at least :data:`moments.MIN_NUMEL` values keeps its moments quantized
(``optim.moments``: ``exp_avg`` signed, ``exp_avg_sq`` unsigned, each as codes and block scales in
the optimizer's state, so ``optimizer.state_dict()`` and checkpoints carry them as they are;
``load_state_dict`` would cast them to the parameter's dtype, prepare's hooks keep them as saved).
A smaller one (biases, norms: a sliver of the memory, and the most sensitive) keeps its moments
and torch's own step, as torchao's low-bit optimizers keep them in fp32.

One step of one parameter, in fp32 on transient copies of that parameter's tensors only (torchao's
``single_param_adam``, the same operations in the same order)::

    AdamW: p <- p - lr * wd * p            Adam: g <- g + wd * p
    m <- lerp(dequant(m), g, 1 - beta1)    v <- lerp(dequant(v), g**2, 1 - beta2)    (stored quantized)
    p <- p - lr * (m / (1 - beta1**t)) / (sqrt(v) / sqrt(1 - beta2**t) + eps)

The moments this step uses are the fp32 ones; what is stored for the next is their quantization.
Nothing here syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.optim import moments

__all__ = ["KEYS", "adam_step", "adam_update", "quantized_moments"]

#: The state keys of a quantized parameter.
KEYS = ("step", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")
_MOMENTS = ("exp_avg", "exp_avg_sq")
Write = Callable[[torch.Tensor, torch.Tensor], None]


def quantized_moments(state: dict[str, Any], p: torch.Tensor, precision: str, capacity: int) -> None:
    """``state``'s moments quantized (in place): zeros for a new one; fp32 moments (a checkpoint of an
    fp32-state run) quantized, their tensors dropped; codes of another precision or layout (a checkpoint of
    another state precision) dequantized and quantized again (``moments.conform``)."""
    if moments.is_quantized(state):
        moments.conform(state, precision, p.numel(), capacity)
        return
    for name in _MOMENTS:
        moment = state.pop(name, None)
        if moment is None:
            moments.zeros(state, name, p.device, precision, capacity)
        else:
            moments.store(state, name, moment.float(), precision, capacity)
    state.setdefault("step", torch.tensor(0.0))


@torch.no_grad()
def adam_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    decoupled: bool,
    precision: str,
    capacity: int = 0,
    write: Write | None = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step of ``p`` (in place) with quantized moments in ``state``.

    ``p`` and ``grad`` are whole tensors or this rank's shards of them (``capacity``: ``moments.store``'s).
    ``write(p, new)`` stores the fp32 result in ``p`` (default ``p.copy_(new)``: rounded to nearest).
    """
    capacity = max(capacity, p.numel())
    quantized_moments(state, p, precision, capacity)
    state["step"] += 1
    step = state["step"]
    m, v, new = adam_update(
        p.float(),
        grad.float(),
        moments.load(state, "exp_avg", p.shape),
        moments.load(state, "exp_avg_sq", p.shape),
        step,
        group,
        decoupled,
    )
    moments.store(state, "exp_avg", m, precision, capacity)
    moments.store(state, "exp_avg_sq", v, precision, capacity)
    if write is None:
        p.copy_(new)
    else:
        write(p, new)


def adam_update(
    p32: torch.Tensor,
    g32: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    group: dict[str, Any],
    decoupled: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam(W)'s arithmetic on fp32 tensors (the module's formulas): the new moments and the new weight, from the
    weight, its gradient, the moments before the step and the step count after it (``step``, a 0-dim tensor)."""
    lr = torch.tensor(float(group["lr"]), dtype=torch.float32)
    beta1, beta2 = (float(b) for b in group["betas"])
    weight_decay, eps = float(group["weight_decay"]), float(group["eps"])
    if decoupled:
        p32 = p32 - lr * weight_decay * p32
    else:
        g32 = g32 + weight_decay * p32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    m = m.lerp(g32, 1 - beta1)
    v = v.lerp(g32.square(), 1 - beta2)
    denom = (v.sqrt() / bias_correction2.sqrt()) + eps
    return m, v, p32 - lr * (m / bias_correction1) / denom
