"""The loss-scale rule beyond torch's: floor, ceiling and hysteresis."""

from __future__ import annotations

import mixprec
from helpers import (
    constant_run,
)


def test_min_and_max_scale() -> None:
    low = mixprec.GradScaler("cpu", init_scale=8.0, min_scale=2.0, fail_after=None)
    assert constant_run(low, lambda i: True, 5) == [4.0, 2.0, 2.0, 2.0, 2.0]
    high = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, max_scale=32.0)
    assert constant_run(high, lambda i: False, 4) == [16.0, 32.0, 32.0, 32.0]


def test_hysteresis_tolerates_overflows() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=64.0, growth_interval=3, hysteresis=2)
    planted = {0, 2, 3, 7}
    scales = constant_run(scaler, lambda i: i in planted, 12)
    # 0: tolerated (2 -> 1); 2: backs off (1 -> 0); 3: backs off again (no growth since);
    # 4, 5, 6 good: grows at 6 and restores the tolerance; 7: tolerated.
    assert scales[:8] == [64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 32.0, 32.0]
