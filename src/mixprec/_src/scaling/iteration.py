"""One iteration of a :class:`GradScaler`, from its first ``scale()`` to its ``update()``: what it has seen.

Host-side bookkeeping; nothing here syncs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["Iteration", "describe", "refresh_per_optimizer_state"]


def refresh_per_optimizer_state() -> dict[str, Any]:
    """One optimizer's state in an iteration, in torch's layout and with torch's stage enum
    (READY / UNSCALED / STEPPED), so code written against torch.amp.GradScaler reads it unchanged."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class Iteration:
    """What one iteration has seen so far, from its first ``scale()`` to its ``update()``."""

    def __init__(self) -> None:
        # Torch's name and layout: code written against torch.amp.GradScaler reaches into it.
        self.per_optimizer: defaultdict[int, dict[str, Any]] = defaultdict(refresh_per_optimizer_state)
        self.host_skipped: dict[int, bool] = {}  # per optimizer, read on the host by a syncing step()
        self.manual_found: list[torch.Tensor] = []  # from unscale(), MegEngine style
        self.manual_flags: list[bool | None] = []
        self.failed: set[int] = set()  # optimizers whose step() raised: the iteration is abandoned

    def in_progress(self) -> bool:
        return any(s["found_inf_per_device"] for s in self.per_optimizer.values()) or bool(self.manual_found)

    def found_infs(self, device: torch.device) -> list[torch.Tensor]:
        """Every inf/NaN flag recorded, on ``device``. No sync."""
        recorded = [f for s in self.per_optimizer.values() for f in s["found_inf_per_device"].values()]
        return [found.to(device=device, non_blocking=True) for found in recorded + self.manual_found]

    def host_flags(self) -> list[bool | None]:
        """Overflow flags the host already read (ordinary step(), unscale()): ``None`` for a fused optimizer's."""
        stepped = [key for key, state in self.per_optimizer.items() if state["found_inf_per_device"]]
        return [self.host_skipped.get(key) for key in stepped] + self.manual_flags


def describe(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__name__} at {id(optimizer):#x}"
