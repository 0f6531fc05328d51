"""custom_fwd / custom_bwd behave as torch.amp's, reading mixprec's state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mixprec


def _make(custom_fwd: Any, custom_bwd: Any, cast_inputs: torch.dtype | None) -> type[torch.autograd.Function]:
    class MyMM(torch.autograd.Function):
        @staticmethod
        @custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            ctx.fwd_dtype = a.mm(b).dtype
            return a.mm(b)

        @staticmethod
        @custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            ctx.bwd_dtype = grad.mm(b.t()).dtype
            return grad.mm(b.t()), a.t().mm(grad)

    return MyMM


@pytest.mark.parametrize("cast_inputs", [None, torch.float32, torch.float16])
def test_matches_torch_amp(cast_inputs: torch.dtype | None) -> None:
    results = []
    for fwd, bwd, autocast in ((torch.amp.custom_fwd, torch.amp.custom_bwd, torch.autocast),
                               (mixprec.custom_fwd, mixprec.custom_bwd, mixprec.autocast)):  # fmt: skip
        fn = _make(fwd, bwd, cast_inputs)
        a = torch.randn(4, 4, requires_grad=True)
        b = torch.randn(4, 4, requires_grad=True)
        torch.manual_seed(0)
        a.data, b.data = torch.randn(4, 4), torch.randn(4, 4)
        with autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(a, b)
        out.float().sum().backward()
        results.append((out.dtype, out.detach(), a.grad, b.grad))
    assert results[0][0] is results[1][0]
    for expected, got in zip(results[0][1:], results[1][1:], strict=True):
        assert torch.equal(expected, got)


def test_backward_runs_under_forward_autocast_state() -> None:
    fn = _make(mixprec.custom_fwd, mixprec.custom_bwd, None)
    a = torch.randn(4, 4, requires_grad=True)
    with mixprec.autocast("cpu", dtype=torch.float16):
        out = fn.apply(a, torch.randn(4, 4))
    assert out.dtype is torch.float16
    ctx = out.grad_fn
    out.float().sum().backward()  # outside any region: custom_bwd re-enters fp16 autocast
    assert ctx.fwd_dtype is torch.float16 and ctx.bwd_dtype is torch.float16


def test_cast_inputs_runs_forward_without_autocast() -> None:
    fn = _make(mixprec.custom_fwd, mixprec.custom_bwd, torch.float32)
    with mixprec.autocast("cpu"):
        out = fn.apply(torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4))
    assert out.dtype is torch.float32


def test_bad_use() -> None:
    with pytest.raises(TypeError, match="device_type as a string"):
        mixprec.custom_fwd(device_type=None)  # type: ignore[arg-type]

    class NoFwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        @mixprec.custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    x = torch.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"forward decorated with mixprec\.custom_fwd"):
        NoFwd.apply(x).sum().backward()
