"""The per-layer plan with the block-scaled formats: chosen by SQNR alone (emulated, never timed), the least
precise one holding the floor; ``mixprec.tuning.plan_layers`` plans a model and its recipe applies the plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.layers.choice import Measured, choose
from mixprec._src.layers.precision import LayerPrecision as P


def _measured(nvfp4: float, mxfp8: float) -> Measured:
    emulated = {P.NVFP4: "block-scaled GEMMs emulated", P.MXFP8: "block-scaled GEMMs emulated"}
    sqnr = {P.NVFP4: nvfp4, P.MXFP8: mxfp8, P.BF16: 50.0}
    return Measured("0", "linear 64->64, 32 rows", {P.FP32: 1.0, P.BF16: 0.5}, sqnr, emulated)


@pytest.mark.parametrize(
    ("nvfp4", "mxfp8", "chosen"),
    [(25.0, 30.0, "nvfp4"), (15.0, 30.0, "mxfp8"), (15.0, 18.0, "bf16")],
    ids=["both hold: the less precise", "nvfp4 below the floor", "neither holds: the recipe's dtype"],
)
def test_a_block_format_is_chosen_by_its_sqnr_the_least_precise_first(nvfp4: float, mxfp8: float, chosen: str) -> None:
    (layer,) = choose([_measured(nvfp4, mxfp8)], "bf16", floor_db=20.0, min_speedup=1.02)
    assert layer.choice == chosen
    if chosen != "bf16":
        assert f"{chosen} by its SQNR" in layer.reason and "time not measured" in layer.reason
    for p, quality in (("nvfp4", nvfp4), ("mxfp8", mxfp8)):
        assert (f"{p} {quality:.1f} dB < 20 dB" in layer.reason) == (quality < 20.0)


def test_without_block_formats_asked_for_the_plan_is_as_it_was() -> None:
    plain = Measured("0", "linear 64->64, 32 rows", {P.FP32: 1.0, P.BF16: 0.5}, {P.BF16: 50.0}, {})
    (layer,) = choose([plain], "bf16", floor_db=20.0, min_speedup=1.02)
    assert layer.choice == "bf16" and layer.reason == "as the recipe has it"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))


@pytest.mark.parametrize(("floor", "chosen"), [(10.0, "nvfp4"), (22.0, "mxfp8"), (40.0, None)])
def test_plan_layers_plans_by_the_floor_and_its_recipe_applies_the_plan(floor: float, chosen: str | None) -> None:
    # at this model's shapes nvfp4 measures 15-17 dB, mxfp8 28-30 dB, bf16 about 50 dB against fp32
    model, x = _net(), torch.randn(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = mixprec.tuning.plan_layers(model, x, sqnr_db=floor, budget_s=30)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not changed
    choices = {c.name: c for c in recipe.layers}
    for name in ("0", "2"):
        if chosen is None:  # bf16 or fp32, as this machine times them
            assert choices[name].choice in ("bf16", "fp32"), choices[name].reason
        else:
            assert choices[name].choice == chosen, choices[name].reason
        assert choices[name].ms_of("nvfp4") is None and choices[name].sqnr_of("nvfp4") is not None  # never timed
    assert "not measured: the output head" in choices["4"].reason  # the head stays out, as prepare has it
    assert any("chosen by SQNR alone" in note for note in recipe.notes)
    applied = recipe.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    if chosen is not None:
        assert mixprec.layer_precision(applied.model, "0") == chosen
    with applied.autocast():
        loss = applied.model(x).float().square().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
