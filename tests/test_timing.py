"""How tune reads noise in its timings: the uncertainty of a median ratio, the gap between the fastest runs."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec._src import timing


def test_steady_timings_have_no_noise_and_too_few_have_none() -> None:
    assert timing.ratio_noise([1.1, 1.1, 1.1]) == 0.0
    assert timing.fastest_noise([2.0, 2.0, 5.0]) == 0.0
    assert timing.ratio_noise([1.0]) is None and timing.fastest_noise([1.0]) is None


def test_one_stalled_step_barely_moves_the_noise_of_a_median() -> None:
    steady = [1.00, 1.02, 0.98, 1.01, 0.99, 1.00, 1.01]
    stalled = [*steady[:-1], 25.0]  # one step hit by another process
    assert timing.ratio_noise(stalled) == pytest.approx(timing.ratio_noise(steady), abs=0.01)
    assert timing.fastest_noise([1.0, 1.01, 40.0]) == pytest.approx(0.01)  # nor a slow run the fastest


def test_the_noise_covers_the_true_ratio_most_of_the_time() -> None:
    # Normal step ratios around 1.0 with sigma 0.1, 9 steps: the true ratio lies within a draw's median
    # +- its noise for about 87% of draws (nominally 95%: a spread read from 9 steps is itself uncertain).
    rng = random.Random(0)
    draws = [[rng.gauss(1.0, 0.1) for _ in range(9)] for _ in range(2000)]
    inside = 0
    for ratios in draws:
        median, noise = sorted(ratios)[4], timing.ratio_noise(ratios)
        assert noise is not None
        inside += abs(median - 1.0) <= noise * median
    assert 0.8 < inside / len(draws) < 0.97


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=2, max_size=12), st.floats(0.01, 100.0))
def test_the_noise_is_relative(values: list[float], scale: float) -> None:
    for noise in (timing.ratio_noise, timing.fastest_noise):
        a, b = noise(values), noise([v * scale for v in values])
        assert a is not None and b is not None and a >= 0 and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
