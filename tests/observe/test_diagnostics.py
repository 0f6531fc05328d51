"""diagnose(): planted overflow, underflow and backward-only NaN are found and named."""

from __future__ import annotations

import json
from typing import Any

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import Overflowing, square_loss


class Underflowing(nn.Module):
    """The gradients reaching ``side`` are 1e-9 of the others: below fp16's smallest subnormal."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.main = nn.Linear(16, 1)
        self.side = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.main(h) + 1e-9 * self.side(h)


class AbsViaSqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # |x|, whose gradient is 0/0 at exact zeros: NaN in backward only


class BackwardNaN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.absval = AbsViaSqrt()
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.absval(self.act(self.inp(x))))


def _x() -> torch.Tensor:
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


def test_planted_overflow_is_named_and_its_rules_remove_it() -> None:
    torch.manual_seed(0)
    model = Overflowing()
    report = mixprec.diagnose(model, _x(), square_loss)
    assert report.overflowing()[0] == "big"
    assert report.module("big").activations.overflow_frac > 0.05
    assert report.first_nonfinite is not None and report.first_nonfinite.pass_ == "forward"
    assert report.first_nonfinite.module == "big"
    assert report.keep_fp32 == ["big"] and report.rules_fix_it is True
    assert report.bf16_avoids_it is True
    # the rules, applied to autocast, make the overflow disappear
    with mixprec.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(_x())).all()
    with mixprec.autocast("cpu", dtype=torch.float16, policy=report.policy("cpu")):
        assert torch.isfinite(model(_x())).all()
    assert mixprec.diagnose(model, _x(), square_loss, policy=report.policy()).first_nonfinite is None


def test_planted_gradient_underflow_is_named() -> None:
    torch.manual_seed(0)
    report = mixprec.diagnose(Underflowing(), _x(), square_loss)
    assert report.underflowing()[0] == "side"
    assert report.module("side").gradients.underflow_frac == 1.0
    assert report.module("main").gradients.underflow_frac == 0.0
    assert report.first_nonfinite is None and report.keep_fp32 == []
    assert report.bf16_avoids_it is True  # bf16's normal range reaches 1e-38
    # with no NaN or Inf, the summary does not say bf16 avoids "it"
    assert "no NaN or Inf in fp16" in report.summary() and "bf16 would avoid it" not in report.summary()
    assert "bf16 would avoid fp16's overflow and underflow here" in report.summary()
    assert any("stay below fp16's normal range" in note for note in report.notes)


def test_backward_only_nan_is_named_with_its_op() -> None:
    torch.manual_seed(0)
    report = mixprec.diagnose(BackwardNaN(), _x(), square_loss)
    first = report.first_nonfinite
    assert first is not None
    assert (first.module, first.module_type, first.pass_) == ("absval", "AbsViaSqrt", "backward")
    assert first.op in {"div", "mul", "sqrt"}
    # the module's forward outputs are finite: only its backward makes NaN
    assert report.module("absval").nan + report.module("absval").inf == 0
    assert all(m.activations.nan == 0 for m in report.modules)  # forward is clean
    # it is broken in fp32 too: no precision rule is offered, and bf16 would not help
    assert report.keep_fp32 == [] and report.bf16_avoids_it is False
    assert any("in fp32 too" in note for note in report.notes)


def test_loss_scale_suggestion_and_bf16_run() -> None:
    torch.manual_seed(0)
    report = mixprec.diagnose(Underflowing(), _x(), square_loss)
    grad_max = max(m.gradients.absmax for m in report.modules)
    scale = report.suggested_loss_scale
    assert grad_max * scale <= 65504 / 8 < grad_max * scale * 2 or scale == 2.0**24
    bf16 = mixprec.diagnose(Overflowing(), _x(), square_loss, dtype="bf16")
    assert bf16.first_nonfinite is None and bf16.suggested_loss_scale == 1.0 and bf16.overflowing() == []


def test_report_outputs(tmp_path: Any) -> None:
    torch.manual_seed(0)
    report = mixprec.diagnose(Overflowing(), _x(), square_loss)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["dtype"] == "fp16" and data["keep_fp32"] == ["big"]
    assert {m["name"] for m in data["modules"]} >= {"inp", "big", "norm", "out", ""}
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report.table())
    assert "big" in console.export_text()
    assert "keep in fp32: big" in report.summary()
    report.plot(tmp_path / "diag.png")
    assert matplotlib.image.imread(tmp_path / "diag.png").shape[0] > 300
    again = mixprec.DiagnosticReport.from_dict(data)  # plain data: JSON and back, equal
    assert again.modules == report.modules and again.first_nonfinite == report.first_nonfinite  # loss may be NaN
    assert json.dumps(again.to_dict()) == json.dumps(report.to_dict()) and again.summary() == report.summary()


def test_model_state_is_left_as_found() -> None:
    model = Overflowing()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mixprec.diagnose(model, _x(), square_loss)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_inputs_as_tuple_and_dict_and_default_loss() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.a(x) * scale

    model = TwoInputs()
    x, s = torch.randn(3, 4), torch.ones(1)
    assert mixprec.diagnose(model, (x, s)).loss is not None
    assert mixprec.diagnose(model, {"x": x, "scale": s}).first_nonfinite is None


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="needs a model with parameters"):
        mixprec.diagnose(nn.ReLU(), torch.randn(3))
    with pytest.raises(ValueError, match="scalar tensor, got \\(32, 1\\)"):
        mixprec.diagnose(Overflowing(), _x(), lambda out: out)
    with pytest.raises(ValueError, match="is on meta but the model is on cpu"):
        mixprec.diagnose(Overflowing(), torch.randn(32, 8, device="meta"), square_loss)
    with pytest.raises(ValueError, match=r"non-floating|unknown"):
        mixprec.diagnose(Overflowing(), _x(), dtype="int8")


def make_overflowing() -> nn.Module:
    torch.manual_seed(0)
    return Overflowing()


def overflowing_batch() -> torch.Tensor:
    return _x()


def test_cli_diagnose_user_model_and_workload(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec import cli

    out = tmp_path / "diag"
    assert cli.main(["diagnose", "--model", "test_diagnostics:make_overflowing", "--batch",
                     "test_diagnostics:overflowing_batch", "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "first appears in the forward pass of big" in text and "keep in fp32: big" in text
    data = json.loads((out / "report.json").read_text())
    assert data["keep_fp32"] == ["big"] and (out / "diagnose.png").exists()
    assert cli.main(["diagnose", "--workload", "transformer", "--out", str(tmp_path / "w")]) == 0
    text = capsys.readouterr().out
    assert "no NaN or Inf in fp16" in text  # the causal mask's -inf is deliberate
    assert "…" not in text and "blocks.layers.0.self_attn" in text  # a log gets the whole table
    assert cli.main(["diagnose", "--model", "nowhere:thing", "--batch", "x:y"]) == 2
    assert "cannot load --model" in capsys.readouterr().err
    assert cli.main(["diagnose", "--model", "test_diagnostics:make_overflowing"]) == 2
    assert "--model needs --batch" in capsys.readouterr().err


def test_inputs_and_targets() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = _x(), torch.randn(32, 1, generator=torch.Generator().manual_seed(1))

    def mse(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out.float(), targets)

    report = mixprec.diagnose(model, x, mse, targets=y)
    with torch.no_grad():
        assert report.loss_fp32 == pytest.approx(float(mse(model(x), y)), rel=1e-6)
    with pytest.raises(ValueError, match=r"targets= needs loss_fn\(output, targets\)"):
        mixprec.diagnose(model, x, targets=y)
    # an (inputs, targets) batch passed as the inputs: the error says what to write instead
    with pytest.raises(TypeError, match=r"diagnose\(model, inputs, loss_fn, targets=targets\)"):
        mixprec.diagnose(model, (x, y), mse)


def overflowing_pair() -> tuple[torch.Tensor, torch.Tensor]:
    return _x(), torch.zeros(32, 1)


def mse_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), targets)


def returns_none() -> None:
    return None


def test_cli_diagnose_loss_takes_output_and_targets(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec import cli

    assert cli.main(["diagnose", "--model", "test_diagnostics:make_overflowing", "--batch",
                     "test_diagnostics:overflowing_pair", "--loss", "test_diagnostics:mse_loss",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    assert "keep in fp32: big" in capsys.readouterr().out
    assert cli.main(["diagnose", "--model", "test_diagnostics:make_overflowing", "--batch",
                     "test_diagnostics:overflowing_batch", "--loss", "test_diagnostics:mse_loss"]) == 2  # fmt: skip
    assert "--batch must return (inputs, targets) when --loss is given" in capsys.readouterr().err


def test_cli_diagnose_finds_modules_in_the_current_folder(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from mixprec import cli

    (tmp_path / "cwd_models_for_test.py").write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(4, 2)\n"
        "def batch():\n    return torch.randn(3, 4)\n"
        "def forgot():\n    torch.nn.Linear(4, 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_models_for_test", raising=False)
    args = ["--batch", "cwd_models_for_test:batch", "--out", str(tmp_path / "out")]
    assert cli.main(["diagnose", "--model", "cwd_models_for_test:build", *args]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["diagnose", "--model", "cwd_models_for_test:forgot", *args]) == 2
    err = capsys.readouterr().err
    assert "--model cwd_models_for_test:forgot returned None; it must return the torch.nn.Module" in err
    assert cli.main(["diagnose", "--model", "test_diagnostics:returns_none", *args]) == 2
    monkeypatch.delitem(sys.modules, "cwd_models_for_test", raising=False)


class _DictOutput(nn.Module):
    """Returns a dict, as Hugging Face models return a ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x)}


def test_diagnose_on_a_model_returning_a_dict_warns_nothing() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = mixprec.diagnose(_DictOutput(), torch.randn(4, 8), lambda out: out["logits"].square().mean())
    assert report.module("lin").gradients.numel == 32  # the submodule still reports its gradient


class _UninitialisedOp:
    """An op that returns memory it never wrote, as empty_like does (NaN bits, here, every time)."""

    def __init__(self, name: str) -> None:
        self.overloadpacket = type("Packet", (), {"__name__": name})()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan"))


def test_uninitialised_memory_is_not_a_nan_the_model_made() -> None:
    # Dropout in training mode fills an empty_like mask in place: the tracer must not read the empty memory
    # as a NaN made from finite inputs (diagnose named Dropout, a different culprit each run, before).
    from mixprec._src.observe.diagnostics import _FirstNonFinite

    def where() -> tuple[str, str, str]:
        return ("0", "Dropout", "forward")

    finite = torch.ones(4)
    for name, blamed in (("empty_like", False), ("new_empty", False), ("mul", True)):
        tracer = _FirstNonFinite(where)
        tracer.__torch_dispatch__(_UninitialisedOp(name), (), (finite,))
        assert (tracer.found is not None) == blamed, name


class _ReturnsADict(nn.Module):
    """A model whose output is a mapping (as Hugging Face's ModelOutput is)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.fc(x)}


def test_a_loss_that_cannot_take_the_models_output_says_what_to_pass() -> None:
    model, x, y = _ReturnsADict(), torch.randn(16, 8), torch.randint(0, 4, (16,))
    with pytest.raises(TypeError, match=r"the model returns a dict, not a tensor.*lambda out, y: F.cross_entropy"):
        mixprec.diagnose(model, x, F.cross_entropy, targets=y)
    report = mixprec.diagnose(model, x, lambda out, y: F.cross_entropy(out["logits"], y), targets=y)
    assert report.first_nonfinite is None
