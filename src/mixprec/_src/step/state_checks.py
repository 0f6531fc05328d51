"""Which optimizers can keep their state at a precision (``PrepareConfig.optimizer_state``): :func:`check`, before
anything is installed. Host-side only: nothing here syncs.
"""

from __future__ import annotations

import torch

from mixprec._src import sharding
from mixprec._src.optim import moments
from mixprec._src.optim.state_precision import StatePrecision
from mixprec._src.step.state_dicts import capacity

__all__ = ["check"]


def check(optimizer: torch.optim.Optimizer, precision: StatePrecision | str) -> None:
    """Raise where ``optimizer`` cannot keep its state at ``precision``, or one of its parameters is sharded
    otherwise than FSDP2's dim 0 (before anything is installed)."""
    if not StatePrecision.from_name(precision).own:
        return
    if precision != moments.BF16:  # bf16 moments are kept elementwise: any sharding
        _check_sharding(optimizer)
    if isinstance(optimizer, torch.optim.SGD) and type(optimizer).__module__.startswith("torch.optim"):
        flags = [n for n in ("maximize", "fused", "differentiable") if any(g.get(n) for g in optimizer.param_groups)]
        if any(not g.get("momentum") for g in optimizer.param_groups):
            flags.append("no momentum (no state to quantize)")
        if not flags:
            return
        raise ValueError(
            f"optimizer_state={precision!r} quantizes SGD's momentum buffer (torch.optim.SGD with "
            f"momentum, without maximize, fused or differentiable); this one has {', '.join(flags)}: "
            "change that, or use optimizer_state='fp32'"
        )
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    if not adam or any(g.get(n) for g in optimizer.param_groups for n in _REFUSED):
        raise ValueError(
            f"optimizer_state={precision!r} quantizes Adam's and AdamW's moments (torch.optim.Adam or "
            f"AdamW, without amsgrad, maximize, capturable or differentiable) and SGD's momentum; "
            f"this optimizer is a {type(optimizer).__name__} with {_flags(optimizer) or 'none of those'}: "
            "use one of them, or optimizer_state='fp32'"
        )


#: Adam(W) options the quantized step does not do (fused=True is fine: the small tensors keep torch's fused step)
_REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")


def _flags(optimizer: torch.optim.Optimizer) -> str:
    return ", ".join(n for n in _REFUSED if any(g.get(n) for g in optimizer.param_groups))


def _check_sharding(optimizer: torch.optim.Optimizer) -> None:
    """Raise where a parameter is sharded otherwise than FSDP2's dim 0 over one mesh dimension."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if sharding.is_sharded(p) and p.numel() >= moments.MIN_NUMEL:
                capacity(p)
