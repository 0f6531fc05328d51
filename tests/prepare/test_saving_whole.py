"""``torch.save(model)`` of a prepared model: it loads computing as the original, still prepared, and trains
again once exported and prepared with an optimizer (the optimizer's hooks are not pickled, as torch pickles no
optimizer's hooks)."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._src.prepare.kept import OwnForward
from mixprec._src.prepare.levels import prepared_state
from mixprec._src.prepare.o2_copies import SwapCall

OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "8bit-in-backward": {"optimizer_state": "8bit", "step_in_backward": True},
    "fp8": {"fp8": "tensorwise"},
    "clipped": {"clip_grad_norm": 1.0},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 16))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 16, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure", "bf16-kahan"])
def test_a_prepared_model_saves_and_loads_whole(level: str, options: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, level, **OPTIONS[options])
    for seed in range(2):
        _step(model, opt, seed)
    loaded = _saved_and_loaded(model)
    state = prepared_state(loaded)
    assert state is not None and state.level.value == level
    own = {id(m) for m in loaded.modules()}
    for h in state.handles:  # the module hooks, the kept norms' own forwards and O2's calls, and only those
        if isinstance(h, OwnForward | SwapCall):
            assert h.module is not None and id(h.module) in own
        else:
            assert h.hooks_dict_ref()
    x = torch.randn(4, 64)
    for train in (False, True):  # O2 computes from its copies; kept norms in fp32; the region and output cast
        model.train(train), loaded.train(train)
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))
    assert [p.dtype for p in loaded.parameters()] == [p.dtype for p in model.parameters()]
    # exported, the loaded model is the original's fp32 model; prepared again, it trains as a copy of it would
    exported, original = mixprec.export_fp32(loaded), mixprec.export_fp32(copy.deepcopy(model))
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), original.state_dict().values(),
                                                 strict=True))  # fmt: skip
    assert not any(
        "forward" in m.__dict__ or "_call_impl" in m.__dict__ or m._forward_pre_hooks for m in exported.modules()
    )
    runs = []
    for net in (exported, original):
        again = torch.optim.AdamW(net.parameters(), lr=1e-2)
        torch.manual_seed(1)  # bf16-sr's seed
        mixprec.prepare(net, again, level, **OPTIONS[options])
        _step(net, again, 7)
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
def test_a_prepared_optimizer_is_not_copied_without_its_stages(level: str) -> None:
    """``copy.copy``, ``copy.deepcopy`` and ``torch.save`` of a prepared optimizer raise, saying what to do (torch
    copies an optimizer's defaults, state and param groups alone: the copy would step as a plain torch optimizer, at
    bf16-sr rounding to nearest); the prepared model still copies and saves whole, and the optimizer copies again
    once exported."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixprec.prepare(model, opt, level)
    _step(model, opt, 0)
    for copier in (copy.copy, copy.deepcopy, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(mixprec.PrepareOrderError, match=r"optimizer\.state_dict"):
            copier(opt)
    copied = copy.deepcopy(model)
    assert prepared_state(copied) is not None and prepared_state(_saved_and_loaded(model)) is not None
    mixprec.export_fp32(model, opt)
    assert isinstance(copy.deepcopy(opt), torch.optim.AdamW)
