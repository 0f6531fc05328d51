"""A checkpoint of one optimizer-state precision loaded into a run of another: converted (dequantized, stored
again at the run's precision), never read in another layout.

Each pair of fp32, bf16, 8bit, 4bit and fp8 state, both ways: a run saves its model and optimizer after some
steps, a run prepared with the other precision loads them and trains on; its loss ends within 1% of the run
that never stopped (the source precision all along), and the process lives.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._src.optim import moments

PRECISIONS = ("fp32", "bf16", "8bit", "4bit", "fp8")
BEFORE, AFTER = 12, 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 8, generator=g)
    out = []
    for _ in range(BEFORE + AFTER):
        x = torch.randn(32, 64, generator=g)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def _prepared(precision: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return mixprec.prepare(model, opt, level="O2", optimizer_state=precision)


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    loss = torch.tensor(0.0)
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return float(loss.detach())


_UNSTOPPED: dict[str, float] = {}


def _unstopped(precision: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    if precision not in _UNSTOPPED:
        _UNSTOPPED[precision] = _train(*_prepared(precision), data)
    return _UNSTOPPED[precision]


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.permutations(PRECISIONS, 2)))
def test_a_checkpoint_of_another_state_precision_trains_on(saved: str, loaded: str) -> None:
    data = _data()
    model, opt = _prepared(saved)
    _train(model, opt, data[:BEFORE])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model, opt = _prepared(loaded)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    resumed = _train(model, opt, data[BEFORE:])
    states = [s for s in opt.state.values() if s]
    if loaded in moments.FORMATS:  # every large weight's moments in the run's own layout
        big = [s for s in states if moments.is_quantized(s)]
        assert big and all(moments.saved_precision(s, n) == loaded for s in big for n in ("exp_avg", "exp_avg_sq"))
    else:  # as the level keeps them (fp32 at O2) or bf16: moments, no codes
        assert all(not moments.is_quantized(s) and "exp_avg" in s for s in states)
    reference = _unstopped(saved, data)
    assert abs(resumed - reference) <= 0.01 * reference, (resumed, reference)


def test_codes_of_no_format_are_refused_with_a_message() -> None:
    state = {"exp_avg_codes": torch.zeros(100, dtype=torch.uint8), "exp_avg_scale": torch.ones(3)}
    with pytest.raises(ValueError, match="none of the formats"):
        moments.conform(state, "8bit", 256, 256)
    state = {"exp_avg_codes": torch.zeros(256, dtype=torch.uint8), "exp_avg_scale": torch.ones(1)}
    with pytest.raises(ValueError, match="holds 256 values and its parameter"):
        moments.conform(state, "8bit", 4096, 4096)
