"""Pickles made by an earlier mixprec still load: whole models with converted layers, scalers, configs.

``torch.save(model)`` records the module paths of what it pickles (``mixprec._src.bound_forward``,
the fp8 layers' scaling modules and configs, the layer-precision forwards); moving a module must
leave its old path importable. ``tests/data/converted_model_before_subpackages.pt`` was written
before ``mixprec._src`` was split into subpackages (layers 0 and 3 in fp8, 4 in bf16, 5 in fp32,
a GradScaler, an ``Fp8Config`` and a ``PrepareConfig``).
"""

from __future__ import annotations

import importlib
import pathlib
import re
import sys
import warnings

import pytest
import torch
from torch import nn

import mixprec
from helpers import ROOT, sqnr
from mixprec._src import _compat

OLD = pathlib.Path(__file__).parent / "data" / "converted_model_before_subpackages.pt"


def test_a_model_pickled_before_the_subpackages_loads_and_computes_the_same() -> None:
    with pytest.warns(DeprecationWarning) as told:
        saved = torch.load(OLD, weights_only=False)
    assert "mixprec._src.fp8_linear moved to mixprec._src.fp8.linear; the old path goes in" in {
        str(w.message).split(" mixprec 0")[0] for w in told
    }
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


def test_every_old_path_imports_its_module_and_warns_once_there() -> None:
    for old, new in _compat.MOVED.items():
        sys.modules.pop(f"mixprec._src.{old}", None)  # as a fresh process meets it
        with pytest.warns(DeprecationWarning, match=f"goes in mixprec {_compat.REMOVED_IN}") as told:
            module = importlib.import_module(f"mixprec._src.{old}")
        assert module is importlib.import_module(f"mixprec._src.{new}") and len(told) == 1, old
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert importlib.import_module(f"mixprec._src.{old}") is module  # imported: no second warning
    with pytest.warns(DeprecationWarning, match="mixprec._src.policy.ModuleRule moved to mixprec._src.policy.rules"):
        from mixprec._src.policy import ModuleRule  # an old pickle's global on the package that replaced policy.py
    assert ModuleRule is mixprec.ModuleRule
    for module, names in _compat.RENAMED.items():  # names that moved out of a module older pickles hold
        for old, new in names.items():
            with pytest.warns(DeprecationWarning, match=f"{module}.{old} moved to mixprec._src.{new};"):
                found = getattr(importlib.import_module(f"mixprec._src.{module}"), old)
            where, _, name = new.rpartition(".")
            assert found is getattr(importlib.import_module(f"mixprec._src.{where}"), name)
    with pytest.raises(AttributeError):
        mixprec._src.tune.no_such_name  # noqa: B018


def test_nothing_but_the_compat_module_forwards_old_names() -> None:
    forwarding = re.compile(r"MetaPathFinder|^def __getattr__", re.MULTILINE)
    found = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("*.py")
                   if forwarding.search(p.read_text()) and "_compat.forward(" not in p.read_text())  # fmt: skip
    assert found == ["mixprec/_src/_compat.py"]
