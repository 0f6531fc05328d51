"""bf16 weights updated with Kahan compensation: level ``"bf16-kahan"`` (optimi's method).

Like ``"bf16-sr"`` the weights and optimizer state are bf16 only and the optimizer steps in fp32;
the write-back differs. Each bf16 weight keeps a bf16 compensation ``c`` (``optimizer.state[p]
["kahan_comp"]``, 2 bytes a parameter, in state dicts and checkpoints): the part of its updates that
rounding to bf16 has dropped so far. A step with fp32 update ``u`` writes::

    y = u + c            s = p + y  (fp32)            p <- bf16(s)  (to nearest)            c <- s - p

so an update far below half a bf16 step accumulates in ``c`` until it moves the weight, exactly
rather than on average (stochastic rounding's way). Adam and AdamW step through one compiled fused
kernel where it compiles; any other optimizer steps fp32 copies with its own code
(``stochastic_rounding``'s generic path with this write). Nothing here syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from mixprec._src import sharding
from mixprec._src.numerics import bf16_nearest
from mixprec._src.optim import cpu_lists
from mixprec._src.step import stochastic_rounding
from mixprec._src.step.sr_kernel import adam_scalars, fused_supported
from mixprec._src.step.stochastic_rounding import PerTensor, install_fused_adam, step_eagerly

__all__ = ["COMP_KEY", "adam_kahan_update", "compensation", "install", "write"]

#: the optimizer-state key of a weight's compensation
COMP_KEY = "kahan_comp"


def write(p: torch.Tensor, new: torch.Tensor, comp: torch.Tensor) -> None:
    """Write the fp32 values ``new`` to the bf16 weight ``p`` with its compensation ``comp`` (both in place)."""
    p32 = p.float()
    y = (new - p32) + comp.float()
    s = p32 + y
    p.copy_(s)
    comp.copy_(s - p.float())


def compensation(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    """``p``'s compensation in ``state``, zeros at first (a DTensor like ``p`` under FSDP2)."""
    comp = state.get(COMP_KEY)
    if comp is None:
        comp = state[COMP_KEY] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return cast(torch.Tensor, comp)


def adam_kahan_update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor, scalars: torch.Tensor
) -> None:
    """One Adam/AdamW step on 1-D bf16 tensors in fp32 math, the weight written with its compensation ``c``.

    ``sr_kernel.adam_sr_update``'s update (the same ``scalars``), with :func:`write` for the write-back.
    """
    decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = scalars.unbind()
    p32, g32 = p.float(), g.float()
    g32 = g32 + l2 * p32
    m32 = m.float() * beta1 + g32 * one_minus_beta1
    v32 = v.float() * beta2 + one_minus_beta2 * g32 * g32
    new = p32 * decay - step_size * m32 / (v32.sqrt() * inv_bc2_sqrt + eps)
    y = (new - p32) + c.float()
    s = p32 + y
    rounded = bf16_nearest(s)  # not s.to(bf16): inductor would keep s in fp32 and make c - rounded zero
    p.copy_(rounded)
    c.copy_(s - rounded)
    m.copy_(m32)
    v.copy_(v32)


_compiled: Callable[..., None] | None = None


def _kernel() -> Callable[..., None] | None:
    global _compiled
    if _compiled is None:
        try:
            compiled = cast(Callable[..., None], torch.compile(adam_kahan_update, fullgraph=True, dynamic=True))
            probe = [torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(5)]  # large: see sr_kernel
            with torch.no_grad():
                compiled(
                    *probe,
                    adam_scalars({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, 1.0, True),
                )
            _compiled = compiled
        except Exception:  # no C++ toolchain: the generic path
            return None
    return _compiled


def install(optimizer: torch.optim.Optimizer, lowp: Iterable[torch.Tensor], handles: list[Any]) -> bool:
    """Make ``optimizer`` write the bf16 tensors ``lowp`` back with Kahan compensation; whether Adam(W)'s fused
    kernel is in use."""
    lowp = list(lowp)
    ids = {id(p) for p in lowp}
    step_eagerly(optimizer, handles)
    kernel = _kernel() if fused_supported(optimizer) else None
    if kernel is None:
        stochastic_rounding.install_generic(optimizer, ids, handles, _generic_write, cpu_lists.KAHAN, compensation)
        return False
    install_fused_adam(
        optimizer,
        ids,
        handles,
        kernel,
        _compensations,
        adam_kahan_update,
        cpu_lists.KAHAN,
        any(sharding.is_sharded(p) for p in lowp),
    )
    return True


def _compensations(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> PerTensor:
    """The fused kernel's extras: each weight's compensation (made at its first step)."""
    return lambda p, state: sharding.local(compensation(state, p))


def _generic_write(param: torch.Tensor, shadow: torch.Tensor, shadow_state: dict[str, Any], seed: int) -> None:
    """The generic path's write-back: the compensation lives in the fp32 copy's state while it steps."""
    local = sharding.local(param.data)
    comp = sharding.local(compensation(shadow_state, shadow))
    write(local, sharding.local(shadow.data).view(local.shape), comp)
