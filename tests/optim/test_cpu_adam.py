"""The CPU block kernel of the quantized-state Adam step (``optim/cpu_adam.py``) against the eager step
(``optim/adam.py``): the same operations and roundings, so the moments' codes and scales are bitwise, and so
are bf16 weights (fp32 weights differ by torch's own CPU ``sqrt``, which is MKL's and not always correctly
rounded: within a unit in the last place of the update)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from mixprec._src.optim import adam, cpu_adam, fused_adam
from mixprec._src.step import kahan
from mixprec._src.step.sr_noise import moved, seed_tensor, sr_bits

pytestmark = pytest.mark.skipif(not cpu_adam.available("8bit", torch.zeros(2), torch.zeros(2)),
                                reason="no C++ toolchain here")  # fmt: skip

GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
KEYS = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")


def _states(precision: str, shape: tuple[int, ...], dtype: torch.dtype, capacity: int, decoupled: bool,
            group: dict[str, Any] = GROUP) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """A parameter and its state after three eager steps (codes of every kind, zeros included)."""
    g = torch.Generator().manual_seed(0)
    p, state = torch.randn(shape, generator=g).to(dtype), {}
    for step in range(3):
        grad = (torch.randn(shape, generator=g) * 10.0 ** -(step % 3)).to(dtype)
        grad.view(-1)[:300] = 0  # second moments that decay toward the smallest code
        adam.adam_step(p, grad, state, group, decoupled, precision, capacity)
    return p, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _native(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], decoupled: bool,
            precision: str, capacity: int, **kwargs: Any) -> None:  # fmt: skip
    assert cpu_adam.available(precision, p, grad)
    fused_adam._step(None, p, grad, state, group, decoupled, precision, capacity, native=True,
                     **{"rounding": None, "seed_at": None, "comp": None, **kwargs})  # fmt: skip


CASES = [((300, 257), 0), ((64, 64), 0), ((1000,), 1300)]  # a partial last block; the room a shard makes


@pytest.mark.parametrize(("shape", "capacity"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
def test_the_block_kernel_is_the_eager_step(precision: str, decoupled: bool, dtype: torch.dtype,
                                           shape: tuple[int, ...], capacity: int) -> None:  # fmt: skip
    p, state = _states(precision, shape, dtype, capacity, decoupled)
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 1e-2).to(dtype)
    eager_p, eager_state = p.clone(), copy.deepcopy(state)
    adam.adam_step(eager_p, grad, eager_state, GROUP, decoupled, precision, capacity)
    _native(p, grad, state, GROUP, decoupled, precision, capacity)
    for key in KEYS:
        assert _same(state[key], eager_state[key]), key
    assert torch.equal(state["step"], eager_state["step"])
    if dtype == torch.bfloat16:
        assert torch.equal(p, eager_p)
    else:  # MKL's sqrt in the eager step: a few values a unit in the last place apart
        torch.testing.assert_close(p, eager_p, rtol=3e-7, atol=GROUP["lr"] * 1e-6)  # the update is about lr
        assert float((p == eager_p).float().mean()) > 0.99


def test_large_betas_take_lerps_other_branch() -> None:
    """ATen's lerp computes ``end - (end - start) * (1 - w)`` for a weight of 0.5 or more (1 - beta1 = 0.7)."""
    group = {**GROUP, "betas": (0.3, 0.4)}
    p, state = _states("8bit", (4096,), torch.bfloat16, 0, True, group)
    grad = torch.randn(4096).to(torch.bfloat16)
    eager_p, eager_state = p.clone(), copy.deepcopy(state)
    adam.adam_step(eager_p, grad, eager_state, group, True, "8bit")
    _native(p, grad, state, group, True, "8bit", 0)
    assert all(torch.equal(state[key], eager_state[key]) for key in KEYS)
    assert torch.equal(p, eager_p)


@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
def test_stochastic_rounding_is_the_eager_writes(precision: str) -> None:
    """bf16-sr's write with each value's noise from its flat position, the last partial block's included."""
    shape, seed = (1000,), 12345
    p, state = _states(precision, shape, torch.bfloat16, 0, True)
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e-2).to(torch.bfloat16)
    eager_p, eager_state = p.clone(), copy.deepcopy(state)

    def write(param: torch.Tensor, new: torch.Tensor) -> None:
        param.copy_(sr_bits(new.reshape(-1), seed_tensor(seed, param.device)).view(torch.float32).view(param.shape))

    adam.adam_step(eager_p, grad, eager_state, GROUP, True, precision, 0, write)
    _native(p, grad, state, GROUP, True, precision, 0, rounding=sr_bits,
            seed_at=lambda offset: seed_tensor(moved(seed, offset), p.device))  # fmt: skip
    assert torch.equal(p, eager_p)
    assert all(_same(state[key], eager_state[key]) for key in KEYS)
    nearest_p, nearest_state = p.clone(), copy.deepcopy(eager_state)  # and it is not rounding to nearest
    adam.adam_step(nearest_p, grad, nearest_state, GROUP, True, precision)
    assert not torch.equal(p, nearest_p)


def test_kahan_writes_the_weight_and_its_compensation_as_the_eager_write() -> None:
    p, state = _states("8bit", (1000,), torch.bfloat16, 0, True)
    comp = (torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 1e-4).to(torch.bfloat16)
    grad = (torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1e-2).to(torch.bfloat16)
    eager_p, eager_state, eager_comp = p.clone(), copy.deepcopy(state), comp.clone()
    adam.adam_step(eager_p, grad, eager_state, GROUP, True, "8bit", 0, functools.partial(kahan.write, comp=eager_comp))
    _native(p, grad, state, GROUP, True, "8bit", 0, comp=comp)
    assert torch.equal(p, eager_p)
    assert torch.equal(comp, eager_comp)
    assert comp.abs().sum() > 0


@pytest.mark.parametrize("precision", ["8bit", "fp8"])
def test_a_positive_second_moment_is_never_stored_as_zero(precision: str) -> None:
    """mixprec's one departure from torchao's formats (a gradient of 1 beside ones of 1e-12: second moments far
    below the block's largest / 448 or its dynamic tree's smallest entry)."""
    grad = torch.full((4096,), 1e-12)
    grad[::256] = 1.0
    p, state = torch.zeros(4096), {}
    _native(p, grad, state, GROUP, True, precision, 0)
    assert (state["exp_avg_sq_codes"].view(torch.uint8) != 0).all()


def test_a_non_finite_gradient_spreads_as_in_the_eager_step() -> None:
    p, state = _states("8bit", (1024,), torch.bfloat16, 0, True)
    grad = torch.randn(1024).to(torch.bfloat16)
    grad[5], grad[700] = float("nan"), float("inf")
    eager_p, eager_state = p.clone(), copy.deepcopy(state)
    adam.adam_step(eager_p, grad, eager_state, GROUP, True, "8bit")
    _native(p, grad, state, GROUP, True, "8bit", 0)
    for key in KEYS:
        torch.testing.assert_close(state[key], eager_state[key], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(p, eager_p, rtol=0, atol=0, equal_nan=True)
    scale = state["exp_avg_scale"]
    assert scale[0].isnan() and scale[2].isinf() and scale[[1, 3]].isfinite().all()


def test_what_the_kernel_does_not_take_goes_elsewhere() -> None:
    x = torch.zeros(512)
    assert cpu_adam.available("4bit", x, x.bfloat16())
    assert not cpu_adam.available("fp16", x, x)
    assert not cpu_adam.available("8bit", x.double(), x)
    assert not cpu_adam.available("8bit", torch.zeros(16, 32).t(), torch.zeros(32, 16))
    assert not cpu_adam.available("8bit", x.to("meta"), x.to("meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_square_norm_reads_low_precision_where_it_lies(dtype: torch.dtype) -> None:
    x = torch.randn(3 * 65536 + 1000 + 7, generator=torch.Generator().manual_seed(1)).to(dtype)  # a ragged end
    norm = cpu_adam.square_norm(x)
    assert norm is not None and norm.dtype == torch.float32
    exact = float(x.double().square().sum())
    assert abs(float(norm) / exact - 1) < 1e-5  # (torch's vector_norm in fp32 measured 1.4e-4 off on 4M values)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_adam.square_norm(x), norm)  # fixed chunks: the same sum on any number of threads
    finally:
        torch.set_num_threads(threads)
    assert cpu_adam.square_norm(x.float()) is None
    assert cpu_adam.square_norm(x[:-7].view(-1, 8).t()) is None
