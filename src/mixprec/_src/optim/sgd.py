"""SGD with its momentum buffer block-wise quantized: one parameter's step.

torch.optim.SGD's update (``momentum``, ``dampening``, ``nesterov``, ``weight_decay``), the buffer
stored quantized (``optim.moments``, signed) between steps and used in fp32 within one::

    g <- g + wd * p
    buf <- g (the first step)   or   momentum * dequant(buf) + (1 - dampening) * g      (stored quantized)
    d <- g + momentum * buf (nesterov)   or   buf
    p <- p - lr * d

Nothing here syncs with the device.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.optim import moments
from mixprec._src.optim.adam import Write

__all__ = ["sgd_step", "sgd_update"]

_BUFFER = "momentum_buffer"


@torch.no_grad()
def sgd_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    precision: str,
    capacity: int = 0,
    write: Write | None = None,
) -> None:
    """One SGD-with-momentum step of ``p`` (in place), the buffer quantized in ``state``."""
    capacity = max(capacity, p.numel())
    saved = state.pop(_BUFFER, None)  # an fp32 buffer (a checkpoint of an fp32-state run)
    if saved is None and moments.is_quantized(state):
        saved = moments.load(state, _BUFFER, p.shape)
    buf, new = sgd_update(p.float(), grad.float(), None if saved is None else saved.float(), group)
    moments.store(state, _BUFFER, buf, precision, capacity)
    if write is None:
        p.copy_(new)
    else:
        write(p, new)


def sgd_update(
    p32: torch.Tensor, g32: torch.Tensor, buf: torch.Tensor | None, group: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD's arithmetic on fp32 tensors (the module's formulas): the new buffer and the new weight, from the weight,
    its gradient and the buffer before the step (``None`` at the first step)."""
    momentum, dampening = float(group["momentum"]), float(group["dampening"])
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    if weight_decay != 0:
        g32 = g32.add(p32, alpha=weight_decay)
    buf = g32.clone() if buf is None else buf.mul(momentum).add(g32, alpha=1 - dampening)
    d = g32.add(buf, alpha=momentum) if group["nesterov"] else buf
    return buf, p32.add(d, alpha=-lr)
