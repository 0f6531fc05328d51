"""Per-layer fp8 statistics: diagnose names the layers where fp8 loses most; the monitor reads them in training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._src.numerics import sqnr


def model_with_an_outlier() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64),
                          nn.GELU(), nn.Linear(64, 1))  # fmt: skip
    with torch.no_grad():
        # One huge weight on an input that is always ~0: it sets layer 4's tensorwise scale, the weights that
        # carry the signal flush to zero in e4m3.
        model[2].weight[0].zero_()
        model[2].bias[0] = -10.0  # GELU(-10) ~ 0
        model[4].weight[0, 0] = 1e5
    return model


def test_diagnose_names_the_fp8_layer_that_loses_most() -> None:
    model = model_with_an_outlier()
    report = mixprec.diagnose(model, torch.randn(64, 32), dtype="bf16", fp8="tensorwise")
    assert [r.name for r in report.fp8][:1] == ["4"] and report.fp8_worst(1) == ["4"]
    assert len(report.fp8) == 3  # the head is left out
    worst, others = report.fp8[0], report.fp8[1:]
    assert worst.casts["weight"]["flushed"] > 0.5 and all(r.casts["weight"]["flushed"] < 0.01 for r in others)
    assert worst.sqnr < 15 < min(r.sqnr for r in others)
    assert set(worst.casts) == {"input", "weight", "grad_output"}
    assert "fp8 loses most in: 4:" in report.summary()
    assert mixprec.DiagnosticReport.from_dict(report.to_dict()).fp8 == report.fp8
    assert all(p.grad is None for p in model.parameters()) and not hasattr(model[0], "fp8")  # model untouched


def test_diagnose_without_fp8_reports_none() -> None:
    report = mixprec.diagnose(nn.Linear(16, 16), torch.randn(4, 16), dtype="bf16")
    assert report.fp8 == [] and "fp8" not in report.summary()
    assert mixprec.DiagnosticReport.from_dict({**report.to_dict()} | {"fp8": []}).fp8 == []


def test_sqnr() -> None:
    x = torch.ones(4)
    assert sqnr(x, x) == math.inf
    assert sqnr(x * 1.1, x) == pytest.approx(20.0)


def test_monitor_reads_fp8_statistics_during_training() -> None:
    model = model_with_an_outlier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mixprec.prepare(model, opt, "O2", fp8="delayed")
    monitor = mixprec.Monitor(model, fp8_stats=True)
    x = torch.randn(32, 32)
    F.mse_loss(model(x), torch.zeros(32, 1)).backward()
    opt.step()
    stats = monitor.fp8_stats()
    assert set(stats) == {"0", "2", "4"} and stats["4"]["weight"]["flushed"] > 0.5
    assert stats["0"]["input"]["amax"] == pytest.approx(float(x.abs().max()), rel=1e-2)  # bf16 input
    monitor.close()
    assert not model[0].fp8.recording and not model[0].fp8.stats
    with pytest.raises(ValueError, match="fp8_stats=True"):
        mixprec.Monitor(model).fp8_stats()


def test_cli_diagnose_reports_fp8_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec import cli

    assert cli.main(["diagnose", "--workload", "mlp", "--dtype", "bf16", "--fp8", "delayed",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    assert "fp8 loses most in:" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["fp8"]


def test_diagnose_takes_a_model_with_fp8_layers_and_says_what_to_pass_for_fp8() -> None:
    model = model_with_an_outlier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mixprec.prepare(model, opt, "O1", fp8="tensorwise")
    report = mixprec.diagnose(model, torch.randn(8, 32), dtype="bf16")  # fp8 tensors are not checked for inf/NaN
    assert report.first_nonfinite is None
    with pytest.raises(ValueError, match=r"before mixprec\.prepare"):
        mixprec.diagnose(model, torch.randn(8, 32), dtype="bf16", fp8="tensorwise")


def test_monitor_asks_for_fp8_layers() -> None:
    with pytest.raises(ValueError, match="needs a model with fp8 layers"):
        mixprec.Monitor(nn.Linear(4, 4), fp8_stats=True)
