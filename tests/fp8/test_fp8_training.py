"""Real training runs with fp8 linears against bf16: the bench's MLP regression, where the linears are the model.

The bench's transformer LM is not the check here: at the sizes a CPU trains in minutes it sits near
its unigram plateau, where even frozen MLP weights end within 1% of bf16 (measured); its figures
come from ``benchmarks/fp8_convergence.py`` (docs/fp8.md). On the MLP, fp8 ends 1.0-1.4% above bf16
after 300 steps (measured; the gap is fp8's quantization noise against a small residual), a run
whose fp8 layers learn nothing ends far above.
"""

from __future__ import annotations

import pytest

from helpers import load_script

pytestmark = pytest.mark.slow

convergence = load_script("benchmarks/fp8_convergence.py")

STEPS = 300


@pytest.fixture(scope="module")
def bf16_loss() -> float:
    return float(convergence.final(convergence.train_workload(None, "mlp", "tiny", STEPS)))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"])
def test_fp8_ends_within_three_percent_of_bf16(recipe: str, bf16_loss: float) -> None:
    losses = convergence.train_workload(recipe, "mlp", "tiny", STEPS)
    assert convergence.final(losses) < 0.2 * losses[0]  # it learned (a run whose fp8 layers do not: above 0.5)
    assert abs(convergence.final(losses) - bf16_loss) / bf16_loss < 0.03
