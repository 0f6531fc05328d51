"""The step's plan: what prepare asked for, as data, and the refusals of a plan that cannot be."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.prepare.levels import prepared_state
from mixprec._src.step.plan import StepPlan


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))


@pytest.mark.parametrize(
    ("level", "options", "expected"),
    [
        ("O1", {}, StepPlan(optimizer="adam")),
        ("O2", {"optimizer_state": "8bit"}, StepPlan(state="8bit", optimizer="adam")),
        ("bf16-sr", {}, StepPlan(write="stochastic", optimizer="adam", bf16_weights=True)),
        ("bf16-kahan", {"clip_grad_norm": 1.0}, StepPlan(write="kahan", optimizer="adam", clip=1.0, bf16_weights=True)),
        ("bf16-pure", {"optimizer_state": "bf16"}, StepPlan(state="bf16", optimizer="adam", bf16_weights=True)),
        ("bf16-sr", {"step_in_backward": True},
         StepPlan(write="stochastic", in_backward=True, optimizer="adam", bf16_weights=True)),
    ],
)  # fmt: skip
def test_prepare_plans_the_step_from_its_config(level: str, options: dict, expected: StepPlan) -> None:  # type: ignore[type-arg]
    model = _model()
    mixprec.prepare(model, torch.optim.AdamW(model.parameters()), level=level, **options)
    state = prepared_state(model)
    assert state is not None and state.step == expected
    assert expected.seeded == (expected.write == "stochastic" or expected.state == "bf16")


def test_the_optimizer_kind_is_read_from_its_class() -> None:
    params = list(_model().parameters())
    assert StepPlan.of(torch.optim.SGD(params, lr=0.1)).optimizer == "sgd"
    assert StepPlan.of(torch.optim.Adam(params)).optimizer == "adam"
    assert StepPlan.of(torch.optim.RMSprop(params)).optimizer == "other"


def test_a_plan_that_cannot_be_is_refused() -> None:
    with pytest.raises(ValueError, match="writes its weights"):
        StepPlan(write="truncate")
    with pytest.raises(ValueError, match="unknown optimizer_state"):
        StepPlan(state="2bit")


def test_the_plan_says_which_kernel_steps_what() -> None:
    said = StepPlan(write="stochastic", state="8bit", optimizer="sgd", bf16_weights=True, in_backward=True).kernels()
    assert "8bit state in one call a param group" in said and "in backward" in said
    assert "on fp32 copies" in StepPlan(write="kahan", optimizer="other", bf16_weights=True).kernels()
    assert "after backward" in StepPlan(optimizer="adam").kernels()
