"""PrepareConfig: one value for what prepare does; the same as the keyword options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal, regression_data, regression_model, weights_seen


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure"])
def test_a_config_prepares_as_the_same_options_do(level: str) -> None:
    runs = []
    for as_config in (False, True):
        torch.manual_seed(7)
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if as_config:
            config = mixprec.PrepareConfig(level=level, keep_names=("2",), output_dtype=None)  # type: ignore[arg-type]
            model, opt = mixprec.prepare(model, opt, config)
        else:
            model, opt = mixprec.prepare(model, opt, level, keep_names="2", output_dtype=None)
        for x, y in regression_data(3):
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert bitwise_equal(runs[0], runs[1])


def test_keep_filter_keeps_the_modules_it_accepts_in_fp32() -> None:
    model = regression_model()
    opt = torch.optim.AdamW(model.parameters())
    config = mixprec.PrepareConfig(level="O2", keep_filter=lambda module, name: name == "5")  # type: ignore[arg-type]
    model, opt = mixprec.prepare(model, opt, config)
    seen = weights_seen(model)
    assert model(regression_data(1)[0][0]).dtype is torch.float32
    assert {name: dtype for name, (dtype, _) in seen.items()} == {
        "0": torch.bfloat16, "1": torch.float32, "3": torch.bfloat16, "5": torch.float32  # the norm, and the head
    }  # fmt: skip


def test_the_configs_policy_reaches_the_prepared_forward() -> None:
    # every Linear moved to fp32: at O1 the prepared model computes what the fp32 model computes
    policy = mixprec.get_policy("cpu").add("fp32", "linear", "addmm", "mm", "matmul")
    x = regression_data(1)[0][0]
    want = regression_model()(x)
    for chosen, equal in ((policy, True), (None, False)):
        model = regression_model()
        config = mixprec.PrepareConfig(level="O1", policy=chosen)  # type: ignore[arg-type]
        model, _ = mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        assert bitwise_equal(model(x), want) is equal


def test_a_config_checks_itself_and_is_not_mixed_with_options() -> None:
    with pytest.raises(ValueError, match="level 'bf16-sr' keeps weights in bf16"):
        mixprec.PrepareConfig(level="bf16-sr", dtype="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown level 'O3'"):
        mixprec.PrepareConfig(level="O3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_filter must be a callable"):
        mixprec.PrepareConfig(keep_filter="head")  # type: ignore[arg-type]
    for word in ("no", "false", 0):  # a string that reads as true is not taken as a switch
        with pytest.raises(TypeError, match="step_in_backward takes True or False"):
            mixprec.PrepareConfig(step_in_backward=word)  # type: ignore[arg-type]
    model = regression_model()
    with pytest.raises(TypeError, match="a PrepareConfig or options, not both"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), mixprec.PrepareConfig(), keep_names="2")
    config = mixprec.PrepareConfig(level="O2", keep_types=nn.LayerNorm, keep_names="5")  # type: ignore[arg-type]
    assert config.keep_types == (nn.LayerNorm,) and config.keep_names == ("5",)
    assert str(config) == "O2 bf16, keep=LayerNorm+'5', output=fp32"
    assert str(mixprec.PrepareConfig()) == "O2 bf16, keep=norm, output=fp32"
