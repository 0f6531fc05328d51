"""Pickles made by an earlier mixprec still load: whole models with converted layers, scalers, configs.

``torch.save(model)`` records the module paths of what it pickles (``mixprec._src.bound_forward``,
the fp8 layers' scaling modules and configs, the layer-precision forwards); moving a module must
leave its old path importable. ``tests/data/converted_model_before_subpackages.pt`` was written
before ``mixprec._src`` was split into subpackages (layers 0 and 3 in fp8, 4 in bf16, 5 in fp32,
a GradScaler, an ``Fp8Config`` and a ``PrepareConfig``).
"""

from __future__ import annotations

import pathlib

import torch
from torch import nn

import mixprec
from helpers import sqnr

OLD = pathlib.Path(__file__).parent / "data" / "converted_model_before_subpackages.pt"


def test_a_model_pickled_before_the_subpackages_loads_and_computes_the_same() -> None:
    saved = torch.load(OLD, weights_only=False)
    model, x = saved["model"], saved["x"]
    assert [mixprec.layer_precision(model, n) for n in ("0", "3", "4", "5")] == [
        "fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"
    ]  # fmt: skip
    # the same layers built now, with the same precisions: bitwise on any CPU (the saved output was computed on
    # another, whose bf16 GEMMs sum in their own order)
    fresh = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 16),
                          nn.Linear(16, 4))  # fmt: skip
    fresh.load_state_dict(model.state_dict())
    for name, precision in zip(("0", "3", "4", "5"), ("fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"), strict=True):
        mixprec.set_layer_precision(fresh, name, precision)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(x), fresh(x)
    assert torch.equal(out, expected)
    assert sqnr(out.detach(), saved["out"].detach()) > 40  # and what it computed when saved, within rounding
    assert isinstance(saved["scaler"], mixprec.GradScaler) and saved["scaler"].get_scale() == 2.0**10
    assert saved["config"] == mixprec.Fp8Config("delayed")
    assert saved["prepare_config"] == mixprec.PrepareConfig(level="O2")
