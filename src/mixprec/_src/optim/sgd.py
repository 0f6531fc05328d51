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

__all__ = ["sgd_step"]

_BUFFER = "momentum_buffer"


@torch.no_grad()
def sgd_step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], precision: str,
             capacity: int = 0, write: Write | None = None) -> None:  # fmt: skip
    """One SGD-with-momentum step of ``p`` (in place), the buffer quantized in ``state``."""
    capacity = max(capacity, p.numel())
    momentum, dampening = float(group["momentum"]), float(group["dampening"])
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    p32, g32 = p.float(), grad.float()
    if weight_decay != 0:
        g32 = g32.add(p32, alpha=weight_decay)
    saved = state.pop(_BUFFER, None)  # an fp32 buffer (a checkpoint of an fp32-state run)
    if saved is not None:
        buf = saved.float().mul(momentum).add(g32, alpha=1 - dampening)
    elif moments.is_quantized(state):
        buf = moments.load(state, _BUFFER, p.shape).mul(momentum).add(g32, alpha=1 - dampening)
    else:
        buf = g32.clone()
    moments.store(state, _BUFFER, buf, precision, capacity)
    d = g32.add(buf, alpha=momentum) if group["nesterov"] else buf
    new = p32.add(d, alpha=-lr)
    if write is None:
        p.copy_(new)
    else:
        write(p, new)
