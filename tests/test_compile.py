"""mixprec.autocast under torch.compile(fullgraph=True): one graph, no breaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import mixprec
from conftest import bitwise_equal


@pytest.fixture(autouse=True)
def _reset_dynamo() -> None:
    torch._dynamo.reset()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


def test_region_inside_compiled_function_is_one_graph() -> None:
    model, x = _model(), torch.randn(4, 8)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            return out, F.mse_loss(out, torch.zeros(4, 4))

    counter = CompileCounter()
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    got = compiled(x)
    assert counter.frame_count == 1  # fullgraph=True would raise on a break; one graph was made
    assert got[0].dtype is torch.bfloat16 and got[1].dtype is torch.float32
    assert bitwise_equal(got, step(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bitwise_equal(got[0], model(x))


def test_compiled_model_inside_eager_region() -> None:
    model, x = _model(), torch.randn(4, 8)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with mixprec.autocast("cpu"):
        got = compiled(x)
        expected = model(x)
    assert counter.frame_count == 1
    assert bitwise_equal(got, expected)


def test_inductor_training_step() -> None:
    model, x = _model(), torch.randn(4, 8)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu"):
            return F.mse_loss(model(x), torch.zeros(4, 4))

    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(x)
    loss.backward()
    assert loss.dtype is torch.float32
    assert all(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(loss, loss_fn(x), atol=7e-2, rtol=7e-2)


def _breaks_of_a_scaled_step(scaler_cls: type, autocast: object) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu")

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with autocast("cpu", dtype=torch.float16):  # type: ignore[operator]
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    for _ in range(2):
        compiled(torch.randn(4, 8))
    return counter.frame_count, sum(counters["graph_break"].values())


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # Dynamo's own
def test_scaled_training_step_breaks_no_more_than_torch_amp() -> None:
    torch_frames, torch_breaks = _breaks_of_a_scaled_step(torch.amp.GradScaler, torch.autocast)
    frames, breaks = _breaks_of_a_scaled_step(mixprec.GradScaler, mixprec.autocast)
    assert frames <= torch_frames and breaks <= torch_breaks, (frames, breaks, torch_frames, torch_breaks)


@pytest.mark.parametrize("spec", ["cpu", "cuda", "compute=fp16,output=fp32"])
def test_policies_compile_to_one_graph(spec: str) -> None:
    model, x = _model(), torch.randn(4, 8)
    # Built-in names work as strings; other policies are built outside the compiled function.
    policy: str | mixprec.Policy = spec if spec in ("cpu", "cuda") else mixprec.get_policy(spec)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            return model(x)

    counter = CompileCounter()
    got = torch.compile(forward, fullgraph=True, backend=counter)(x)
    assert counter.frame_count == 1
    assert bitwise_equal(got, forward(x))
