"""bf16-sr's Adam(W) update as one fused kernel: each tensor read and written once, rounded stochastically.

:func:`adam_sr_update` is the update (fp32 arithmetic on bf16 storage, the noise of
``sr_noise``), compiled once per process where a C++ toolchain allows (:func:`compiled_kernel`,
else ``None`` and the optimizer's own step runs on fp32 copies). Nothing here syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from mixprec._src.step.sr_noise import sr_bits

__all__ = ["adam_scalars", "adam_sr_update", "compiled_kernel", "fused_supported"]


def adam_sr_update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, scalars: torch.Tensor
) -> None:
    """One Adam/AdamW step on 1-D bf16 tensors in fp32 math, weights written back with stochastic rounding.

    The same update as torch.optim.Adam/AdamW (amsgrad, maximize off). ``scalars`` holds, per step:
    decay (AdamW's ``1 - lr * weight_decay``, else 1), l2 (Adam's ``weight_decay``, else 0),
    beta1, ``1 - beta1``, beta2, ``1 - beta2``, ``lr / (1 - beta1**step)``, ``1 / sqrt(1 - beta2**step)``
    and eps. Compiled into one fused loop, so each tensor is read and written once.
    """
    decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = scalars.unbind()
    p32, g32 = p.float(), g.float()
    g32 = g32 + l2 * p32
    p32 = p32 * decay
    # torch's lerp(g, 1 - beta1), written out: inductor's lerp with a scalar from a tensor ran 3x slower
    m32 = m.float() * beta1 + g32 * one_minus_beta1
    v32 = v.float() * beta2 + one_minus_beta2 * g32 * g32
    p32 = p32 - step_size * m32 / (v32.sqrt() * inv_bc2_sqrt + eps)
    p.copy_(sr_bits(p32, seed).view(torch.float32))
    m.copy_(m32)
    v.copy_(v32)


def adam_scalars(group: dict[str, Any], step: float, decoupled: bool) -> torch.Tensor:
    """The per-step scalars of :func:`adam_sr_update` for one param group (a CPU tensor the kernels only read: the
    last one made is handed out again for the same values, as a step in backward asks once a weight)."""
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    key = (lr, weight_decay, eps, beta1, beta2, step, decoupled)
    if _last[0] == key:
        return _last[1]  # type: ignore[no-any-return]
    decay, l2 = (1.0 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
    step_size = lr / (1.0 - beta1**step)
    inv_bc2_sqrt = 1.0 / (1.0 - beta2**step) ** 0.5
    scalars = torch.tensor([decay, l2, beta1, 1.0 - beta1, beta2, 1.0 - beta2, step_size, inv_bc2_sqrt, eps])
    _last[:] = [key, scalars]
    return scalars


_last: list[Any] = [None, None]  # adam_scalars' last values and tensor


_compiled_adam_sr: Callable[..., None] | None = None
_PROBE_GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def fused_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the fused kernel steps this optimizer's bf16 weights: torch's Adam or AdamW in any form (default,
    ``foreach``, ``fused``: the form only says how torch would step them) without amsgrad, maximize, capturable or
    differentiable."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(
        not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable") and not g.get("differentiable")
        for g in optimizer.param_groups
    )


def compiled_kernel() -> Callable[..., None] | None:
    global _compiled_adam_sr
    if _compiled_adam_sr is None:
        try:
            compiled = cast(Callable[..., None], torch.compile(adam_sr_update, fullgraph=True, dynamic=True))
            # The probe compiles the one graph every parameter uses: under no_grad as step() calls it
            # (grad mode is among the guards), and large, because inductor picks threads and loop
            # shapes from the first sizes it sees (a tiny probe gave a single-threaded kernel).
            probe = [torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(4)]
            with torch.no_grad():
                compiled(*probe, torch.zeros((), dtype=torch.int32), adam_scalars(_PROBE_GROUP, 1.0, True))
            _compiled_adam_sr = compiled
        except Exception:  # no C++ toolchain, an unsupported platform: keep the generic path
            return None
    return _compiled_adam_sr
