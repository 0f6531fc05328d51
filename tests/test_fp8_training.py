"""A real training run: the bench's transformer with fp8 linears ends within 1% of bf16's final loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "fp8_convergence", Path(__file__).resolve().parent.parent / "benchmarks" / "fp8_convergence.py"
)
assert _spec is not None and _spec.loader is not None
convergence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convergence)

STEPS = 150


@pytest.fixture(scope="module")
def bf16_loss() -> float:
    return float(convergence.final(convergence.train(None, "tiny", STEPS)))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"])
def test_fp8_ends_within_one_percent_of_bf16(recipe: str, bf16_loss: float) -> None:
    losses = convergence.train(recipe, "tiny", STEPS)
    assert losses[-1] < 0.7 * losses[0]  # it learned
    assert abs(convergence.final(losses) - bf16_loss) / bf16_loss < 0.01
