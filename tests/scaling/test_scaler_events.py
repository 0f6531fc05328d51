"""What a GradScaler reports: skip, backoff and growth events to listeners and the log."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from helpers import (
    scaled_backward,
    scaler_model,
    small_scaler,
    train_some,
)


def test_listeners_hear_skips_until_removed() -> None:
    model, scaler = scaler_model(), small_scaler("mixprec")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    heard: list[str] = []
    listener = heard.append
    scaler.add_listener(lambda event: listener(event.kind))
    other: list[Any] = []
    scaler.add_listener(other.append)
    train_some(scaler, model, opt, range(3))  # an inf at step 1: one skip, one backoff
    assert heard and other and len(heard) == len(other)
    scaler.remove_listener(other.append)  # a bound method equal to the one added
    scaler.remove_listener(other.append)  # again: ignored
    before = len(other)
    train_some(scaler, model, opt, range(3, 5))  # NaN at step 4
    assert len(other) == before and len(heard) > before


def test_skips_are_reported_per_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    scaler = small_scaler("mixprec")
    model0, opt0 = scaled_backward(scaler)
    next(model0.parameters()).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    with caplog.at_level(logging.INFO, logger="mixprec.scaler"):
        assert scaler.step(opt0) is None
    assert scaler.skipped(opt0)
    assert "skipped optimizer.step() for SGD" in caplog.text
    scaler.update()
    stats = scaler.stats()
    assert (stats.updates, stats.skipped_iterations, stats.consecutive_skipped) == (1, 1, 1)
    assert stats.history == ((1, 2.0**10, 2.0**9),)
    with pytest.raises(RuntimeError, match="never called for this optimizer"):
        scaler.skipped(torch.optim.SGD(scaler_model().parameters(), lr=0.1))
