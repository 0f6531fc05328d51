"""Fail fast: a run that only overflows at the scale's floor raises, with what to try."""

from __future__ import annotations

import pytest
import torch

import mixprec
from helpers import (
    class_batches,
    constant_run,
    fp16_loss,
    scaled_backward,
    scaler_model,
)


def test_fail_fast_explains_the_likely_causes() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, fail_after=5)
    with pytest.raises(
        mixprec.LossScaleCollapseError, match=r"the last 5 iterations all had inf/NaN.*bf16.*learning rate"
    ):
        constant_run(scaler, lambda i: True, 20)
    assert scaler.stats().consecutive_skipped == 5


def test_fail_fast_not_at_the_floor_keeps_going() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**30, fail_after=3)
    assert len(constant_run(scaler, lambda i: True, 6)) == 6  # still far above the floor


def test_fail_fast_fires_when_the_scale_is_not_finite() -> None:
    # A tensor new_scale is not checked (that would sync): an infinite one skips every step, and
    # backing off cannot make it finite, so fail_after must fire although the scale is above the floor.
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, fail_after=3)
    scaled_backward(scaler)
    scaler.update(torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match=r"the last 3 iterations all had inf/NaN.*scale is inf \(not finite\)"):
        constant_run(scaler, lambda i: False, 10)


def test_fail_fast_fires_with_a_scale_set_by_hand() -> None:
    # Static scaling through update(new_scale): the skipped steps still count toward fail_after.
    scaler = mixprec.GradScaler("cpu", init_scale=1.0, fail_after=4)
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = class_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"the last 4 iterations all had inf/NaN.*at its floor"):
        for _ in range(10):
            opt.zero_grad()
            scaler.scale(fp16_loss(model, x, y) * float("inf")).backward()
            scaler.step(opt)
            scaler.update(1.0)
    assert scaler.stats().consecutive_skipped == 4
