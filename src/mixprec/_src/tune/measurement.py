"""A candidate recipe as :func:`mixprec.tune` measured it (:class:`Measurement`), and how far it may drift from
fp32's training (:class:`Tolerance`). Plain data."""

from __future__ import annotations

import dataclasses

__all__ = ["Measurement", "Tolerance"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a candidate's first training steps may drift from fp32's, from the same weights and batch.

    The defaults let bf16 and fp16 autocast through (their rounding gives losses within a few
    tenths of a percent and gradients with cosine similarity above 0.999 on ordinary models) and
    reject what changes training: a loss off by more than 2%, gradients pointing elsewhere
    (cosine < 0.99: an overflowed or flushed layer), or weight updates that lose their direction
    (cosine < 0.9: updates rounded away in low-precision weights).

    Attributes:
        loss_rtol: largest relative difference of the loss at any compared step.
        grad_cos: smallest cosine similarity of the first step's gradients (all parameters, flattened).
        update_cos: smallest cosine similarity of the weight change after the compared steps.
    """

    loss_rtol: float = 0.02
    grad_cos: float = 0.99
    update_cos: float = 0.9

    def __post_init__(self) -> None:
        if not (self.loss_rtol >= 0 and -1 <= self.grad_cos <= 1 and -1 <= self.update_cos <= 1):
            raise ValueError("Tolerance needs loss_rtol >= 0 and cosine floors in [-1, 1]")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate as measured: speed against torch.amp's default and error against fp32."""

    name: str
    status: str  # "chosen", "passed", "rejected" or "not measured"
    step_ms: float | None = None
    vs_default: float | None = None  # steps/s relative to torch.amp's default, same round
    loss_err: float | None = None
    grad_cos: float | None = None
    update_cos: float | None = None
    reason: str = ""
    noise: float | None = None  # vs_default's uncertainty: half an approximate 95% interval, relative (timing)
