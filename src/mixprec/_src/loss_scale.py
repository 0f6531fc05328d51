"""The dynamic loss-scale rule: when the scale backs off and when it grows, written once.

:class:`LossScaleRule` holds the settings; :meth:`LossScaleRule.counters` is the rule, and it
runs on device tensors (GradScaler's update, no sync) and on Python numbers (the host-side
mirror that reports events from flags the host already read) alike, like jmp's
``DynamicLossScale.adjust``. The state is three values: the scale, the good iterations in a
row, and the overflows still tolerated (Megatron-LM's hysteresis; ``hysteresis=1`` is
torch.amp's rule, applied with torch's own kernel so the scale is torch's bit for bit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def _host_where(condition: Any, a: Any, b: Any) -> Any:
    return a if condition else b


@dataclasses.dataclass(frozen=True)
class LossScaleRule:
    """The settings of the rule (GradScaler's constructor arguments of the same names)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def counters(self, good: Any, tolerated: Any, overflow: Any) -> tuple[Any, Any, Any, Any]:
        """One iteration of the rule: ``(good, tolerated, back_off, grow)`` after it.

        ``good`` counts good iterations in a row, ``tolerated`` the overflows still tolerated
        before a backoff; an overflow backs off once ``tolerated`` reaches 0, and
        ``growth_interval`` good iterations in a row grow the scale and restore ``tolerated``.
        Takes int32 tensors and a bool tensor (no sync), or Python ints and a bool.
        """
        on_device = isinstance(overflow, torch.Tensor)
        where = torch.where if on_device else _host_where
        tolerated = tolerated - (overflow.to(tolerated.dtype) if on_device else int(overflow))
        back_off = overflow & (tolerated <= 0)
        counted = where(overflow, 0, good + 1)
        grow = counted >= self.growth_interval
        return where(grow, 0, counted), where(grow, self.hysteresis, tolerated), back_off, grow

    def update_(self, scale: torch.Tensor, good: torch.Tensor, tolerated: torch.Tensor, found: torch.Tensor) -> None:
        """Apply one iteration to the device state in place; ``found > 0`` means it overflowed (no sync)."""
        if self.hysteresis == 1:
            # torch's own kernel: the same scale as torch.amp.GradScaler, bit for bit.
            torch._amp_update_scale_(scale, good, found, self.growth_factor, self.backoff_factor,
                                     self.growth_interval)  # fmt: skip
        else:
            new_good, new_tolerated, back_off, grow = self.counters(good, tolerated, found > 0)
            grown = scale * self.growth_factor
            new_scale = torch.where(
                back_off, scale * self.backoff_factor, torch.where(grow & grown.isfinite(), grown, scale)
            )
            good.copy_(new_good)
            tolerated.copy_(new_tolerated)
            scale.copy_(new_scale)
        if self.min_scale is not None or self.max_scale is not None:
            scale.clamp_(min=self.min_scale, max=self.max_scale)
