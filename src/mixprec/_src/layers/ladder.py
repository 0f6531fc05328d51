"""When the guard moves a layer, and where to: its thresholds, the ladder of precisions, one move.

:class:`GuardThresholds` holds the signals' thresholds and the ladder (validated: a rung only goes
up, nvfp4 -> mxfp8 -> fp8 -> 16 bits -> fp32, and never round); :class:`LayerMove` is one decision. Plain data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mixprec._src.layers.precision import LayerPrecision as P
from mixprec._src.layers.precision import parse_precision

__all__ = ["LADDER", "GuardThresholds", "LayerMove"]

#: The default ladder: where a layer goes when it fails in its precision.
LADDER: dict[P, P] = {
    P.NVFP4: P.MXFP8,
    P.MXFP8: P.FP8_TENSORWISE,
    P.FP8_DELAYED: P.FP8_TENSORWISE,
    P.FP8_TENSORWISE: P.FP8_ROWWISE,
    P.FP8_ROWWISE: P.BF16,
    P.FP8_ROWWISE_WITH_GW_HP: P.BF16,
    P.FP16: P.BF16,
    P.BF16: P.FP32,
}


@dataclasses.dataclass(frozen=True)
class GuardThresholds:
    """When :class:`Guard` moves a layer, as data.

    Attributes:
        patience: consecutive steps with a signal before the layer moves (one bad batch is not a bad layer).
        backward_scale: a non-finite backward counts against a layer when the loss scale it ran with
            was at or below this (without a scaler the scale is 1): above it, backing off is the scaler's job.
        fp16_margin: an fp16 layer whose output amax exceeds this fraction of fp16's largest value
            (65504) is about to overflow.
        saturated: fp8: largest fraction of a cast tensor's values clamped at the format's max.
        flushed: fp8: largest fraction of a cast tensor's non-zero values flushed to zero.
        amax_jump: fp8: an input or output-gradient amax this many times its peak of earlier steps.
        warmup: steps before amax jumps count (early training moves amaxes a lot).
        ladder: precision -> the next one up (see :data:`LADDER`); a precision without an entry stays.
    """

    patience: int = 2
    backward_scale: float = 1.0
    fp16_margin: float = 0.5
    saturated: float = 1e-3
    flushed: float = 0.5
    amax_jump: float = 100.0
    warmup: int = 10
    ladder: Mapping[Any, Any] = dataclasses.field(default_factory=lambda: dict(LADDER))

    def __post_init__(self) -> None:
        if not (isinstance(self.patience, int) and not isinstance(self.patience, bool) and self.patience >= 1):
            raise ValueError(f"patience must be an int >= 1, got {self.patience!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        for field, low, high in (
            ("backward_scale", 0, math.inf),
            ("fp16_margin", 0, 1),
            ("saturated", 0, 1),
            ("flushed", 0, 1),
            ("amax_jump", 1, math.inf),
        ):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and low < value <= high):
                raise ValueError(f"{field} must be a number in ({low:g}, {high:g}], got {value!r}")
        ladder = {parse_precision(a): parse_precision(b) for a, b in self.ladder.items()}
        for a, b in ladder.items():
            if b is P.FP8_DELAYED or b.rung < a.rung or a is P.FP32:
                raise ValueError(
                    f"the ladder moves {a} down to {b}; a rung goes up: nvfp4 -> mxfp8 -> fp8 -> 16 bits -> fp32, and "
                    "never to fp8-delayed (a whole-model recipe)"
                )
        for start in ladder:  # fp16 and bf16 are one rung: a ladder may go either way, not both
            seen, at = {start}, start
            while at in ladder:
                at = ladder[at]
                if at in seen:
                    raise ValueError(f"the ladder goes round from {start} back to {at}; leave one of them out")
                seen.add(at)
        object.__setattr__(self, "ladder", ladder)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = dataclasses.asdict(self)
        out["ladder"] = dict(self.ladder)
        return out


@dataclasses.dataclass(frozen=True)
class LayerMove:
    """One decision of the guard: ``layer`` moved ``from_`` -> ``to`` after ``step`` for ``signal``."""

    step: int
    layer: str
    from_: str
    to: str
    signal: str
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.layer} {self.from_} -> {self.to} ({self.signal}: {self.detail})"
