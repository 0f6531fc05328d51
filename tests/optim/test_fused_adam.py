"""The compiled Adam step with quantized moments against the eager one it fuses (``optim/adam.py``): the same
algorithm, rounded differently only where ATen fuses a multiply-add (its lerp) and inductor does not."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from helpers import requires_cuda
from mixprec._src.optim import adam, fused_adam, moments
from mixprec._src.step.sr_noise import moved, seed_tensor, sr_bits

pytestmark = pytest.mark.skipif(not fused_adam.available(), reason="inductor does not compile here")


@pytest.fixture(autouse=True)
def _the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled graph (on the CPU, the step takes ``cpu_adam``'s kernel)."""
    monkeypatch.setattr(fused_adam, "NATIVE", False)


GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _states(precision: str, shape: tuple[int, ...], dtype: torch.dtype, capacity: int, decoupled: bool,
            steps: int = 3) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """A parameter and its quantized state after a few eager steps (codes of every kind, zeros included)."""
    g = torch.Generator().manual_seed(0)
    p, state = torch.randn(shape, generator=g).to(dtype), {}
    for step in range(steps):
        grad = (torch.randn(shape, generator=g) * 10.0 ** -(step % 3)).to(dtype)
        grad.view(-1)[:300] = 0  # a stretch of zero gradients: second moments that decay toward the smallest code
        adam.adam_step(p, grad, state, GROUP, decoupled, precision, capacity)
    return p, state


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return float((a == b).float().mean())


CASES = [((300, 257), 0), ((64, 64), 0), ((1000,), 1300)]  # a partial last block; the room a shard makes


def _graphs() -> list[Any]:
    """Each (precision, decoupled, dtype) is a graph of its own, compiled anew on a machine without inductor's
    cache (5-9 s each here). The default suite compiles six that hold every pair of the three: each precision
    with both decay forms and both dtypes, each decay form with both dtypes. The slow suite, all twelve."""
    default = {
        ("8bit", True, torch.float32), ("8bit", False, torch.bfloat16), ("4bit", True, torch.bfloat16),
        ("4bit", False, torch.float32), ("fp8", True, torch.float32), ("fp8", False, torch.bfloat16),
    }  # fmt: skip
    params = []
    for precision in ("8bit", "4bit", "fp8"):
        for decoupled in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                marks = () if (precision, decoupled, dtype) in default else pytest.mark.slow
                name = f"{precision}-{'adamw' if decoupled else 'adam'}-{str(dtype).removeprefix('torch.')}"
                params.append(pytest.param(precision, decoupled, dtype, marks=marks, id=name))
    return params


@pytest.mark.parametrize(("shape", "capacity"), CASES)
@pytest.mark.parametrize(("precision", "decoupled", "dtype"), _graphs())
def test_one_compiled_step_is_the_eager_step_up_to_rounding(precision: str, decoupled: bool, dtype: torch.dtype,
                                                            shape: tuple[int, ...], capacity: int) -> None:  # fmt: skip
    p, state = _states(precision, shape, dtype, capacity, decoupled)
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 1e-2).to(dtype)
    eager_p, eager_state = p.clone(), copy.deepcopy(state)
    adam.adam_step(eager_p, grad, eager_state, GROUP, decoupled, precision, capacity)
    fused_adam.adam_step(p, grad, state, GROUP, decoupled, precision, capacity)
    for name in ("exp_avg", "exp_avg_sq"):
        assert _agree(state[f"{name}_codes"], eager_state[f"{name}_codes"]) > 0.999, name
        torch.testing.assert_close(state[f"{name}_scale"], eager_state[f"{name}_scale"], rtol=1e-6, atol=0)
    assert torch.equal(state["step"], eager_state["step"])
    tolerance = {"rtol": 1.6e-2, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-9}
    torch.testing.assert_close(p, eager_p, **tolerance)  # bf16: a flip of the last bit at most
    assert _agree(p, eager_p) > 0.95  # measured: at least 98.6% bitwise


@requires_cuda
@pytest.mark.parametrize(("shape", "capacity"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
def test_on_cuda_the_compiled_step_is_the_eager_step_up_to_rounding(
    precision: str, dtype: torch.dtype, shape: tuple[int, ...], capacity: int
) -> None:
    """On the GPU inductor makes the graph a Triton kernel: the eager step on the GPU, up to the same rounding."""
    p, state = _states(precision, shape, dtype, capacity, True)
    p, state = p.cuda(), {k: v.cuda() for k, v in state.items()}
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 1e-2).to(dtype).cuda()
    eager_p, eager_state = p.clone(), copy.deepcopy(state)
    adam.adam_step(eager_p, grad, eager_state, GROUP, True, precision, capacity)
    fused_adam.adam_step(p, grad, state, GROUP, True, precision, capacity)
    assert p.is_cuda and state["exp_avg_codes"].is_cuda
    for name in ("exp_avg", "exp_avg_sq"):
        assert _agree(state[f"{name}_codes"], eager_state[f"{name}_codes"]) > 0.999, name
        torch.testing.assert_close(state[f"{name}_scale"], eager_state[f"{name}_scale"], rtol=1e-6, atol=0)
    tolerance = {"rtol": 1.6e-2, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-9}
    torch.testing.assert_close(p, eager_p, **tolerance)
    assert _agree(p, eager_p) > 0.95


@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
def test_the_blocks_past_the_values_hold_zeros_as_the_eager_step_stores_them(precision: str) -> None:
    p, state = _states(precision, (1000,), torch.float32, 1300, True)
    fused_adam.adam_step(p, torch.ones(1000), state, GROUP, True, precision, 1300)
    eager_p, eager_state = _states(precision, (1000,), torch.float32, 1300, True)
    adam.adam_step(eager_p, torch.ones(1000), eager_state, GROUP, True, precision, 1300)
    bits, block = moments.FORMATS[precision]
    per_block, first_empty = block * bits // 8, -(-1000 // block)  # code bytes a block; the first block past 1000
    for name in ("exp_avg", "exp_avg_sq"):
        codes, theirs = state[f"{name}_codes"], eager_state[f"{name}_codes"]
        assert _agree(codes[first_empty * per_block :], theirs[first_empty * per_block :]) == 1.0
        assert torch.equal(state[f"{name}_scale"][first_empty:], eager_state[f"{name}_scale"][first_empty:])


def test_stochastic_rounding_uses_each_elements_own_noise_in_the_last_block() -> None:
    """The last, partial block runs on a padded copy: its noise must be that of its elements' positions."""
    shape, seed = (1000,), 12345
    p, state = _states("8bit", shape, torch.bfloat16, 0, True)
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e-2).to(torch.bfloat16)
    eager_p, eager_state = p.clone(), copy.deepcopy(state)

    def write(param: torch.Tensor, new: torch.Tensor) -> None:
        param.copy_(sr_bits(new.reshape(-1), seed_tensor(seed, param.device)).view(torch.float32).view(param.shape))

    adam.adam_step(eager_p, grad, eager_state, GROUP, True, "8bit", 0, write)
    fused_adam.adam_step(p, grad, state, GROUP, True, "8bit", 0, sr_bits,
                         lambda offset: seed_tensor(moved(seed, offset), p.device))  # fmt: skip
    tail = slice(3 * 256, 1000)
    assert _agree(p[tail], eager_p[tail]) > 0.98
    assert _agree(p[: 3 * 256], eager_p[: 3 * 256]) > 0.98


@pytest.mark.parametrize("precision", ["8bit", "fp8"])
def test_a_positive_second_moment_is_never_stored_as_zero_compiled(precision: str) -> None:
    """mixprec's one departure from torchao's formats holds in the kernel too (a gradient of 1 beside ones of
    1e-12: second moments far below the block's largest / 448 or its dynamic tree's smallest entry)."""
    grad = torch.full((4096,), 1e-12)
    grad[::256] = 1.0
    p, state = torch.zeros(4096), {}
    fused_adam.adam_step(p, grad, state, GROUP, True, precision)
    codes = state["exp_avg_sq_codes"]
    assert (codes.view(torch.uint8) != 0).all()
