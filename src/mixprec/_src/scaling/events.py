"""What a GradScaler tells its listeners and its logger: skips, backoffs, growths, and counters.

The host learns of an overflow only from flags it has already read (an ordinary ``step()``
syncs to read them); :class:`EventLog` runs the loss-scale rule on those flags, on the host,
to know when the scale backed off or grew without another sync. Reading the new scale for
the log syncs, on a backoff or a growth only (rare).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any

import torch

from mixprec._src.scaling.loss_scale import LossScaleRule

__all__ = ["EventLog", "ScalerEvent", "ScalerStats"]

logger = logging.getLogger("mixprec.scaler")


@dataclasses.dataclass(frozen=True)
class ScalerEvent:
    """Something the scaler did: ``kind`` is ``"skip"`` (an optimizer step skipped for inf/NaN),
    ``"backoff"`` (the scale shrank) or ``"growth"`` (it grew); ``update`` counts updates so far."""

    kind: str
    update: int
    scale: float | None
    optimizer: str | None = None


@dataclasses.dataclass(frozen=True)
class ScalerStats:
    """Counters for logging; reading them syncs with the device.

    Attributes:
        scale: the current scale.
        updates: ``update()`` calls so far.
        skipped_iterations: updates whose iteration had inf/NaN gradients.
        consecutive_skipped: how many of the latest updates in a row had them.
        history: the latest scale changes as ``(update index, old scale, new scale)``.
    """

    scale: float
    updates: int
    skipped_iterations: int
    consecutive_skipped: int
    history: tuple[tuple[int, float, float], ...]


class EventLog:
    """The listeners, the host's mirror of the rule's counters, and the recent scales.

    Pickles without its listeners (callbacks rarely pickle; add them again after loading).
    """

    def __init__(self, on_event: Any, hysteresis: int, history: int) -> None:
        self.listeners: list[Any] = [on_event] if on_event is not None else []
        self.good = 0  # good iterations in a row, as far as the host has seen them
        self.tolerated = hysteresis
        self.scales: collections.deque[tuple[int, torch.Tensor]] = collections.deque(maxlen=max(2, history + 1))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["listeners"] = []
        state["scales"] = collections.deque(maxlen=self.scales.maxlen)
        return state

    def emit(self, kind: str, update: int, scale: float | None, optimizer: str | None = None) -> None:
        event = ScalerEvent(kind, update, scale, optimizer)
        for listener in list(self.listeners):
            listener(event)

    def skipped(self, optimizer: str, update: int) -> None:
        """An ordinary ``step()`` skipped ``optimizer`` (described) for inf/NaN gradients."""
        logger.info("skipped optimizer.step() for %s: gradients hold inf/NaN", optimizer)
        self.emit("skip", update, None, optimizer)

    def updated(self, rule: LossScaleRule, overflow: bool, update: int, read_scale: Any) -> None:
        """The iteration ended with ``overflow`` as the host read it: report a backoff or growth.

        ``read_scale()`` gives the new scale (a sync), called only when there is one to report.
        """
        self.good, self.tolerated, back_off, grow = rule.counters(self.good, self.tolerated, overflow)
        if back_off:
            scale = read_scale()
            logger.info("loss scale backed off to %g after inf/NaN gradients", scale)
            self.emit("backoff", update, scale)
        elif grow:
            scale = read_scale()
            logger.debug("loss scale grew to %g after %d good iterations", scale, rule.growth_interval)
            self.emit("growth", update, scale)

    def record(self, update: int, scale: torch.Tensor) -> None:
        """Remember the scale after ``update`` (a device copy: no sync)."""
        self.scales.append((update, scale.clone()))

    def changes(self) -> tuple[tuple[int, float, float], ...]:
        """The recent scale changes as ``(update, old, new)``. Syncs."""
        points = [(i, float(s.item())) for i, s in self.scales]
        return tuple((i, a, b) for (_, a), (i, b) in itertools.pairwise(points) if a != b)
