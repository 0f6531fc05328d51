"""Real training runs with block-scaled linears against bf16: the bench's transformer and a config-built Llama on
``benchmarks/block_convergence.py``'s second-order Markov language over 16 tokens, 300 steps.

On TinyLM (which learns the first-order part and levels off) MXFP8 ends within 0.5% of bf16's held-out loss and
NVFP4 with its whole recipe within 3%. The Llama is still learning at step 300, and there runs differ by
more than the formats do: fp8 tensorwise ended 1.2% *below* bf16 on the development machine, MXFP8 0.1% below,
NVFP4 1.7% above; its bounds are 1.5% and 3%. Every run learned. The full table, with NVFP4's ablations and
the planned recipe, is docs/block_formats.md's.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers import load_script

pytestmark = pytest.mark.slow

convergence = load_script("benchmarks/block_convergence.py")

STEPS = 300


def _final(model: str, run: str) -> dict[str, Any]:
    result: dict[str, Any] = convergence.train(convergence.MODELS[model], run, STEPS, lambda: None)
    return result


@pytest.fixture(scope="module")
def bf16() -> dict[str, float]:
    return {model: _final(model, "bf16")["final"] for model in convergence.MODELS}


BOUNDS = {("tinylm", "mxfp8"): 0.005, ("tinylm", "nvfp4"): 0.03, ("llama", "mxfp8"): 0.015, ("llama", "nvfp4"): 0.03}


@pytest.mark.parametrize(("model", "run"), list(BOUNDS))
def test_a_block_format_ends_within_its_distance_of_bf16(model: str, run: str, bf16: dict[str, float]) -> None:
    result, within = _final(model, run), BOUNDS[model, run]
    assert result["final"] < result["losses"][0] - 0.25  # it learned (TinyLM 2.9 -> 2.6, the Llama 2.8 -> 1.7)
    assert abs(result["final"] - bf16[model]) / bf16[model] < within, (result["final"], bf16[model])
    assert result["share"] > 0.6  # most of the GEMM FLOPs were block-scaled
