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

import mixprec

OLD = pathlib.Path(__file__).parent / "data" / "converted_model_before_subpackages.pt"


def test_a_model_pickled_before_the_subpackages_loads_and_computes_the_same() -> None:
    saved = torch.load(OLD, weights_only=False)
    model, x = saved["model"], saved["x"]
    assert [mixprec.layer_precision(model, n) for n in ("0", "3", "4", "5")] == [
        "fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"
    ]  # fmt: skip
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert torch.equal(out, saved["out"])
    assert isinstance(saved["scaler"], mixprec.GradScaler) and saved["scaler"].get_scale() == 2.0**10
    assert saved["config"] == mixprec.Fp8Config("delayed")
    assert saved["prepare_config"] == mixprec.PrepareConfig(level="O2")
