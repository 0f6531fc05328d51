"""SGD with its momentum buffer quantized: torch's SGD with the buffer passed through the quantizer, bitwise;
bitwise resume; bf16-sr's rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from helpers import resumed
from mixprec._src.optim import moments
from mixprec._src.optim import quantize as q


def _quantized(buffer: torch.Tensor, precision: str) -> torch.Tensor:
    bits, block = moments.FORMATS[precision]
    packed = q.quantize_fp8(buffer, block) if precision == "fp8" else q.quantize(buffer, bits, True, block)
    return q.dequantize(packed)


OPTIONS = [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
           {"momentum": 0.8, "dampening": 0.1}]  # fmt: skip


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
def test_a_step_is_torchs_sgd_with_its_buffer_passed_through_the_quantizer(precision: str, options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)
    reference = nn.Linear(128, 64, bias=False)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **options)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, **options)
    mixprec.prepare(model, optimizer, "O1", optimizer_state=precision)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        grad = torch.randn(64, 128, generator=g) * 10.0 ** -(step % 3)
        model.weight.grad, reference.weight.grad = grad.clone(), grad.clone()
        optimizer.step()
        theirs.step()
        state = theirs.state[reference.weight]
        state["momentum_buffer"] = _quantized(state["momentum_buffer"], precision)
        assert torch.equal(model.weight.detach(), reference.weight.detach()), step
    assert set(optimizer.state[model.weight]) == {"momentum_buffer_codes", "momentum_buffer_scale"}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 64, generator=g)
        optimizer.zero_grad()
        loss = (model(x).float() - x[:, :1].sin()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["O1", "bf16-sr"])
def test_sgd_resumes_from_its_state_dict_bit_for_bit(level: str) -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        return mixprec.prepare(model, optimizer, level, optimizer_state="8bit")

    whole = _train(*fresh(), range(8))
    model, optimizer = fresh()
    first = _train(model, optimizer, range(4))
    model, optimizer, _ = resumed(model, optimizer, fresh)
    assert first + _train(model, optimizer, range(4, 8)) == whole
    assert whole[-1] < whole[0]


def test_sgd_at_bf16_sr_rounds_as_the_level_does() -> None:
    moved = {}
    for state in ("8bit", "fp32"):
        model = nn.Linear(256, 64, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        optimizer = torch.optim.SGD(model.parameters(), lr=2.0**-11, momentum=0.9)
        torch.manual_seed(0)
        mixprec.prepare(model, optimizer, "bf16-sr", optimizer_state=state)
        model.weight.grad = -torch.ones_like(model.weight)  # the first step moves every weight by lr
        optimizer.step()
        moved[state] = model.weight.detach().float() - 1.0
    share = (moved["8bit"] != 0).float().mean()
    assert 0.045 < share < 0.08  # a sixteenth of a bf16 step, rounded stochastically
    assert torch.equal(moved["8bit"], moved["fp32"])


def test_sgd_without_momentum_has_no_state_to_quantize() -> None:
    model = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"SGD's momentum buffer .* no momentum \(no state to quantize\)"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", optimizer_state="8bit")


def test_sgd_update_is_torchs_sgd_step_with_nesterov_bit_for_bit() -> None:
    from mixprec._src.optim import sgd

    g = torch.Generator().manual_seed(0)
    p, grad, buf = (torch.randn(300, generator=g) for _ in range(3))
    group = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True}
    new_buf, new_p = sgd.sgd_update(p, grad, buf, group)
    ref = nn.Parameter(p.clone())
    ref.grad = grad.clone()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, foreach=False)
    opt.state[ref]["momentum_buffer"] = buf.clone()
    opt.step()
    assert torch.equal(new_p, ref.detach()) and torch.equal(new_buf, opt.state[ref]["momentum_buffer"])
