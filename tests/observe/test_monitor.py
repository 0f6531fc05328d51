"""Monitor and scaler events: the bad step's first non-finite module is named, healthy steps cost no sync."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import HostSyncs


class Blowup(nn.Module):
    """Multiplies by a huge factor when armed: the fp16 output overflows at a chosen step."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1e6 if self.armed else 1.0)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Blowup(), nn.Linear(16, 16), nn.Linear(16, 1))


def test_skipped_step_names_the_module_and_events_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    events: list[mixprec.ScalerEvent] = []
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, on_event=events.append)
    incidents: list[mixprec.Incident] = []
    monitor = mixprec.Monitor(model, scaler, callback=incidents.append)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with caplog.at_level(logging.DEBUG, logger="mixprec"):
        for step in range(6):
            model[2].armed = step == 3
            opt.zero_grad()
            with mixprec.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    monitor.close()
    assert len(incidents) == 1
    incident = incidents[0]
    assert (incident.reason, incident.pass_) == ("skipped step", "forward")
    assert incident.module == "2"  # Blowup: its fp16 output passes 65504
    assert [e.kind for e in events] == ["growth", "skip", "backoff", "growth"]
    assert events[2].scale == 2.0**8  # grew to 2**9 at update 2, backed off at update 4
    assert "first non-finite value in the forward pass at 2 (Blowup)" in caplog.text
    assert "loss scale backed off to 256" in caplog.text


def test_backward_only_nan_is_found_in_backward() -> None:
    class NaNGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            return grad * float("nan")

    class Poison(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return NaNGrad.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Poison(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    monitor = mixprec.Monitor(model, scaler)
    loss = model(torch.randn(2, 4)).sum()
    assert monitor.check(loss) is None  # the loss is fine: only the gradients go bad
    scaler.scale(loss).backward()
    scaler.step(opt)  # skipped: the NaN gradients make the monitor replay
    scaler.update()
    assert scaler.skipped(opt) and len(monitor.incidents) == 1
    incident = monitor.incidents[0]
    assert (incident.reason, incident.pass_, incident.module) == ("skipped step", "backward", "1")  # Tanh's output
    monitor.close()


def test_check_on_a_bf16_run_and_clean_close() -> None:
    model = _model()
    monitor = mixprec.Monitor(model)
    with mixprec.autocast("cpu"):
        loss = model(torch.randn(2, 8)).float().sum()
    assert monitor.check(loss) is None
    model[2].armed = True
    with mixprec.autocast("cpu"):
        loss = (model(torch.randn(2, 8) * 1e35).float() * 1e10).sum()
    incident = monitor.check(loss)
    assert incident is not None and incident.reason == "non-finite loss"
    monitor.close()
    assert not any(m._forward_hooks for m in model.modules())
    assert not model._forward_pre_hooks


def test_healthy_steps_do_not_sync(host_syncs: HostSyncs) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # fused: the scaler's step reads nothing
    scaler = mixprec.GradScaler("cpu")
    monitor = mixprec.Monitor(model, scaler)
    for _ in range(3):
        with host_syncs:  # whole training steps, watched
            opt.zero_grad()
            with mixprec.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 8)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert host_syncs.names() == []
    assert monitor.incidents == [] and not scaler.skipped(opt)
    monitor.close()
