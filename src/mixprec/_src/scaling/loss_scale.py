"""The dynamic loss-scale rule: when the scale backs off and when it grows, written once.

:class:`LossScaleRule` holds the settings; :meth:`LossScaleRule.counters` is the rule, and it
runs on device tensors (GradScaler's update, no sync) and on Python numbers (the host-side
mirror that reports events from flags the host already read) alike, like jmp's
``DynamicLossScale.adjust``. The state is three values: the scale, the good iterations in a
row, and the overflows still tolerated (Megatron-LM's hysteresis; ``hysteresis=1`` is
torch.amp's rule, applied with torch's own kernel so the scale is torch's bit for bit), plus
two skip counters. :class:`LossScaleState` holds them as numbers (what a checkpoint or a
pickle carries); :class:`DeviceLossScale` holds them as device tensors that the rule updates
in place, without syncs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["DeviceLossScale", "LossScaleRule", "LossScaleState"]


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
            torch._amp_update_scale_(scale, good, found, self.growth_factor, self.backoff_factor, self.growth_interval)
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


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The loss scale's state as plain numbers: what a checkpoint holds.

    Attributes:
        scale: the loss scale.
        good: good iterations in a row toward the next growth (torch's ``_growth_tracker``).
        tolerated: overflows still tolerated before a backoff (``_hysteresis_tracker``).
        skipped: iterations skipped for inf/NaN gradients so far.
        consecutive: how many of the latest iterations in a row were skipped.
    """

    scale: float
    good: int = 0
    tolerated: int = 1
    skipped: int = 0
    consecutive: int = 0


class DeviceLossScale:
    """The state as tensors on the device the loss lives on; nothing here syncs except :meth:`read`."""

    def __init__(self, state: LossScaleState, device: torch.device) -> None:
        self.scale = torch.full((), state.scale, dtype=torch.float32, device=device)
        self.good = torch.full((), state.good, dtype=torch.int32, device=device)
        self.tolerated = torch.full((), state.tolerated, dtype=torch.int32, device=device)
        self.skips = torch.tensor((state.skipped, state.consecutive), dtype=torch.int64, device=device)

    def read(self) -> LossScaleState:
        """The state as numbers. Syncs."""
        skipped, consecutive = self.skip_counts()
        return LossScaleState(
            float(self.scale.item()), int(self.good.item()), int(self.tolerated.item()), skipped, consecutive
        )

    def skip_counts(self) -> tuple[int, int]:
        """(skipped iterations, consecutive skipped iterations). Syncs once."""
        skipped, consecutive = self.skips.tolist()
        return int(skipped), int(consecutive)

    def load(self, state: LossScaleState) -> None:
        """Overwrite the tensors in place with ``state`` (tensors captured elsewhere see it)."""
        self.scale.fill_(state.scale)
        self.good.fill_(state.good)
        self.tolerated.fill_(state.tolerated)
        self.skips.copy_(torch.tensor((state.skipped, state.consecutive)))

    def count_skips(self, found: torch.Tensor) -> None:
        """Count an iteration whose summed inf/NaN flags are ``found`` (> 0: skipped). No sync."""
        counted = (found > 0).to(self.skips.dtype)
        self.skips[0] += counted  # skipped iterations
        self.skips[1] = (self.skips[1] + 1) * counted  # consecutive skipped iterations

    def update(self, rule: LossScaleRule, found: torch.Tensor) -> None:
        """Apply ``rule`` for an iteration whose summed inf/NaN flags are ``found``. No sync."""
        rule.update_(self.scale, self.good, self.tolerated, found)
