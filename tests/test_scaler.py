"""GradScaler against torch.amp.GradScaler, recipe by recipe, plus what torch's lacks."""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from conftest import HostSyncs, bitwise_equal

SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}
# Iteration -> what to plant in one gradient after backward: overflow, NaN, and a run of two.
INJECT = {1: float("inf"), 4: float("nan"), 7: float("inf"), 8: float("-inf")}


def _model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def _plant(params: list[nn.Parameter], step: int) -> None:
    if step in INJECT and params[0].grad is not None:
        params[0].grad.view(-1)[0] = INJECT[step]


def _scaler(kind: str, **kwargs: Any) -> Any:
    return SCALERS[kind]("cpu", init_scale=2.0**10, growth_interval=3, **kwargs)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def recipe_typical(kind: str) -> tuple[Any, ...]:
    model, scaler = _model(), _scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scales = []
    for i, (x, y) in enumerate(_batches(12)):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters()), opt.state_dict()["state"]


def recipe_clipping(kind: str) -> tuple[Any, ...]:
    model, scaler = _model(), _scaler(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scales = []
    for i, (x, y) in enumerate(_batches(12)):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(list(model.parameters()), i)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters()), opt.state_dict()["state"]


def recipe_gradient_penalty(kind: str) -> tuple[Any, ...]:
    model, scaler = _model(), _scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = []
    for i, (x, y) in enumerate(_batches(10)):
        opt.zero_grad()
        loss = _loss(model, x, y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        penalty = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled_grads]).sum().sqrt()
        scaler.scale(loss + penalty).backward()
        _plant(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters())


def recipe_two_losses_two_optimizers(kind: str) -> tuple[Any, ...]:
    model0, model1, scaler = _model(0), _model(1), _scaler(kind)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.1)
    opt1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
    scales, skipped = [], []
    for i, (x, y) in enumerate(_batches(12)):
        opt0.zero_grad()
        opt1.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, F.one_hot(y, 4).float())
            loss1 = F.mse_loss(3 * out0 - 5 * out1, F.one_hot(y, 4).float())
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        _plant(list(model1.parameters()), i)  # only optimizer 1 sees the bad values
        scaler.unscale_(opt0)
        r0 = scaler.step(opt0)
        r1 = scaler.step(opt1)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append((r0, r1))
    return scales, list(model0.parameters()), list(model1.parameters()), opt1.state_dict()["state"]


def recipe_accumulation(kind: str) -> tuple[Any, ...]:
    model, scaler = _model(), _scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    batches = _batches(24)
    for update in range(12):
        for x, y in batches[2 * update : 2 * update + 2]:
            scaler.scale(_loss(model, x, y) / 2).backward()
        _plant(list(model.parameters()), update)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters())


def recipe_fused_adamw(kind: str) -> tuple[Any, ...]:
    model, scaler = _model(), _scaler(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scales = []
    for i, (x, y) in enumerate(_batches(10)):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(list(model.parameters()), i)
        if i % 2:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters()), opt.state_dict()["state"]


RECIPES: list[Callable[[str], tuple[Any, ...]]] = [
    recipe_typical,
    recipe_clipping,
    recipe_gradient_penalty,
    recipe_two_losses_two_optimizers,
    recipe_accumulation,
    recipe_fused_adamw,
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__.removeprefix("recipe_"))
def test_recipe_matches_torch_bitwise(recipe: Callable[[str], tuple[Any, ...]]) -> None:
    expected, got = recipe("torch"), recipe("mixprec")
    assert expected[0] == got[0], "scale trajectories differ"
    assert len(set(got[0])) > 2, "the recipe should see the scale move both ways"
    assert bitwise_equal(expected[1:], got[1:])


def test_injections_do_skip_and_back_off() -> None:
    scales = recipe_typical("mixprec")[0]
    # inf at 1, NaN at 4, inf at 7 and 8 each halve the scale; 9, 10, 11 good: it doubles.
    assert scales == [1024.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0, 128.0, 64.0, 64.0, 64.0, 128.0]


def test_listeners_hear_skips_until_removed() -> None:
    model, scaler = _model(), _scaler("mixprec")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    heard: list[str] = []
    listener = heard.append
    scaler.add_listener(lambda event: listener(event.kind))
    other: list[Any] = []
    scaler.add_listener(other.append)
    _train_some(scaler, model, opt, range(3))  # an inf at step 1: one skip, one backoff
    assert heard and other and len(heard) == len(other)
    scaler.remove_listener(other.append)  # a bound method equal to the one added
    scaler.remove_listener(other.append)  # again: ignored
    before = len(other)
    _train_some(scaler, model, opt, range(3, 5))  # NaN at step 4
    assert len(other) == before and len(heard) > before


# --- state dicts ---------------------------------------------------------------------


def _train_some(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    batches = _batches(steps.stop)
    for i in steps:
        x, y = batches[i]
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize(("first", "second"), [("torch", "mixprec"), ("mixprec", "torch"), ("mixprec", "mixprec")])
def test_state_dicts_interchange(first: str, second: str) -> None:
    model, reference = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    scaler_a, ref_scaler = _scaler(first), _scaler("torch")
    _train_some(scaler_a, model, opts[0], range(0, 5))
    _train_some(ref_scaler, reference, opts[1], range(0, 5))
    scaler_b = SCALERS[second]("cpu")  # default settings: everything comes from the state dict
    scaler_b.load_state_dict(scaler_a.state_dict())
    assert scaler_b.get_scale() == ref_scaler.get_scale()
    assert scaler_b.get_growth_interval() == 3
    _train_some(scaler_b, model, opts[0], range(5, 11))
    _train_some(ref_scaler, reference, opts[1], range(5, 11))
    assert scaler_b.get_scale() == ref_scaler.get_scale()
    assert bitwise_equal(list(model.parameters()), list(reference.parameters()))


def test_state_dict_round_trips_every_field() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, min_scale=0.5, max_scale=2.0**20, hysteresis=3, fail_after=7)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_some(scaler, model, opt, range(0, 9))
    saved = scaler.state_dict()
    restored = mixprec.GradScaler("cpu")
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert set(saved) >= {"scale", "_growth_tracker", "min_scale", "max_scale", "hysteresis", "_hysteresis_tracker",
                          "fail_after", "updates", "skipped_iterations", "consecutive_skipped"}  # fmt: skip
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == saved


def test_pickle_refuses_mid_iteration_and_a_clone_trains_on_alike() -> None:
    model, scaler = _model(), _scaler("mixprec", hysteresis=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_some(scaler, model, opt, range(0, 5))
    x, y = _batches(6)[5]
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="at the start of an iteration or after update"):
        pickle.dumps(scaler)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="at the start of an iteration or after update"):
        pickle.dumps(scaler)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()  # the recent-scale history is not pickled
    twin = copy.deepcopy(model)
    # The original and the clone go on alike (plain SGD holds no state): every counter came along.
    _train_some(scaler, model, opt, range(6, 12))
    _train_some(clone, twin, torch.optim.SGD(twin.parameters(), lr=0.1), range(6, 12))
    assert clone.state_dict() == scaler.state_dict()
    assert bitwise_equal(list(model.parameters()), list(twin.parameters()))


def test_load_state_dict_rejects_bad_dicts() -> None:
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="disabled GradScaler"):
        scaler.load_state_dict({})
    good = mixprec.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match=r"unknown \['typo'\]"):
        scaler.load_state_dict({**good, "typo": 1})
    with pytest.raises(ValueError, match=r"missing \['_growth_tracker'\]"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})


# --- misuse --------------------------------------------------------------------------


def _scaled_backward(scaler: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    return model, opt


def test_misuse_raises_with_what_to_do() -> None:
    scaler = mixprec.GradScaler("cpu")
    _, opt = _scaled_backward(scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"already been called on this optimizer.*once per optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"after step.*before scaler.step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called.*update\(\) once"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"no inf/NaN checks.*before update"):
        scaler.update()
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: 0.0)
    fresh = mixprec.GradScaler("cpu")
    with pytest.raises(RuntimeError, match=r"before scale\(\).*scaler.scale\(loss\).backward"):
        fresh.step(opt)
    with pytest.raises(TypeError, match="tensor or an iterable of tensors"):
        scaler.scale([torch.ones(1), "loss"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor must be in \\(0, 1\\)"),
        ({"growth_interval": 0}, "growth_interval must be a positive"),
        ({"init_scale": 0.0}, "init_scale must be positive"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "must not exceed max_scale"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"fail_after": 0}, "fail_after must be a positive count or None"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mixprec.GradScaler("cpu", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_without_gpu_warns_and_disables_like_torch() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = mixprec.GradScaler()
    assert not scaler.is_enabled()


def test_disabled_scaler_passes_everything_through() -> None:
    scaler = mixprec.GradScaler("cpu", enabled=False)
    loss = torch.tensor(3.0, requires_grad=True)
    assert scaler.scale(loss) is loss
    assert scaler.scale([loss]) == [loss]
    model, opt = _model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    before = copy.deepcopy(list(model.parameters()))
    assert scaler.backward(_loss(model, x, y), opt) is False
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    scaler.update()
    assert not bitwise_equal(before, list(model.parameters()))  # the step ran
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    assert scaler.unscale(opt) is False
    assert scaler.skipped(opt) is False
    assert not scaler.is_enabled()


# --- beyond torch ----------------------------------------------------------------------


def _constant_run(scaler: mixprec.GradScaler, plant: Callable[[int], bool], steps: int) -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for i, (x, y) in enumerate(_batches(steps)):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        if plant(i):
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_min_and_max_scale() -> None:
    low = mixprec.GradScaler("cpu", init_scale=8.0, min_scale=2.0, fail_after=None)
    assert _constant_run(low, lambda i: True, 5) == [4.0, 2.0, 2.0, 2.0, 2.0]
    high = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, max_scale=32.0)
    assert _constant_run(high, lambda i: False, 4) == [16.0, 32.0, 32.0, 32.0]


def test_hysteresis_tolerates_overflows() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=64.0, growth_interval=3, hysteresis=2)
    planted = {0, 2, 3, 7}
    scales = _constant_run(scaler, lambda i: i in planted, 12)
    # 0: tolerated (2 -> 1); 2: backs off (1 -> 0); 3: backs off again (no growth since);
    # 4, 5, 6 good: grows at 6 and restores the tolerance; 7: tolerated.
    assert scales[:8] == [64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_fail_fast_explains_the_likely_causes() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, fail_after=5)
    with pytest.raises(
        mixprec.LossScaleCollapseError, match=r"the last 5 iterations all had inf/NaN.*bf16.*learning rate"
    ):
        _constant_run(scaler, lambda i: True, 20)
    assert scaler.stats().consecutive_skipped == 5


def test_fail_fast_not_at_the_floor_keeps_going() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**30, fail_after=3)
    assert len(_constant_run(scaler, lambda i: True, 6)) == 6  # still far above the floor


def test_skips_are_reported_per_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    scaler = _scaler("mixprec")
    model0, opt0 = _scaled_backward(scaler)
    next(model0.parameters()).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    with caplog.at_level(logging.INFO, logger="mixprec.scaler"):
        assert scaler.step(opt0) is None
    assert scaler.skipped(opt0)
    assert "skipped optimizer.step() for SGD" in caplog.text
    scaler.update()
    stats = scaler.stats()
    assert (stats.updates, stats.skipped_iterations, stats.consecutive_skipped) == (1, 1, 1)
    assert stats.history == ((1, 2.0**10, 2.0**9),)
    with pytest.raises(RuntimeError, match="never called for this optimizer"):
        scaler.skipped(torch.optim.SGD(_model().parameters(), lr=0.1))


def test_scheduler_does_not_advance_on_skipped_step() -> None:
    scaler = _scaler("mixprec")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for i, (x, y) in enumerate(_batches(4)):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        if i == 0:  # the first step is skipped: torch's scheduler would warn here
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        scaler.step_scheduler(sched)  # warnings are errors in this suite
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 0.5, 0.25, 0.125]


def test_fused_optimizer_step_does_not_sync(host_syncs: HostSyncs) -> None:
    scaler = _scaler("mixprec")
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    for x, y in _batches(3):
        with host_syncs:  # scale, backward, step and update: no read of any tensor's data
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert host_syncs.names() == []  # no found_inf.item(): the fused kernel reads found_inf itself
    assert scaler.skipped(opt) is False


def test_unfused_step_reads_the_flag_once_and_nothing_else_syncs(host_syncs: HostSyncs) -> None:
    scaler = _scaler("mixprec")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # no step tensor: SGD reads nothing itself
    x, y = _batches(1)[0]
    with host_syncs:
        loss = scaler.scale(_loss(model, x, y))
        loss.backward()
        scaler.unscale_(opt)
    assert host_syncs.names() == []  # scale and unscale_ never sync
    with host_syncs:
        scaler.step(opt)
    assert len(host_syncs.names()) == 1  # step reads the inf/NaN flag, once for the one device
    with host_syncs:
        scaler.update()
    assert host_syncs.names() == []  # update: none


def test_low_precision_gradients_are_unscaled() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        model = _model().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
        x, y = _batches(1)[0]
        scaler.scale(F.cross_entropy(model(x.to(dtype)).float(), y)).backward()
        scaled = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        scaler.unscale_(opt)  # torch.amp.GradScaler raises "Attempting to unscale FP16 gradients."
        for p, g in zip(model.parameters(), scaled, strict=True):
            assert torch.equal(p.grad, (g.float() * (1 / 2.0**8)).to(dtype))  # fp32 math, one rounding


def test_megengine_automatic_style() -> None:
    scaler = _scaler("mixprec")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    assert scaler.backward(_loss(model, x, y), opt) is False
    assert scaler.stats().updates == 1
    opt.step()
    model.zero_grad()
    poisoned = _loss(model, x, y) * float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.backward(poisoned, model.parameters()) is True
    assert all(p.grad is None for p in model.parameters())  # dropped: the step changes nothing
    opt.step()
    assert bitwise_equal(before, [p.detach() for p in model.parameters()])
    assert scaler.get_scale() == 2.0**9


def test_megengine_manual_style_matches_torch() -> None:
    results = []
    for style in ("torch", "manual"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = _scaler("torch" if style == "torch" else "mixprec")
        for i, (x, y) in enumerate(_batches(8)):
            opt.zero_grad()
            if style == "torch":
                scaler.scale(_loss(model, x, y)).backward()
                _plant(list(model.parameters()), i)
                scaler.step(opt)
            else:
                _loss(model, x, y).backward(gradient=torch.tensor(scaler.scale_factor))
                _plant(list(model.parameters()), i)
                scaler.unscale(model.parameters())
                opt.step()
            scaler.update()
        results.append((scaler.get_scale(), list(model.parameters())))
    assert bitwise_equal(results[0], results[1])


def test_scale_nested_iterables() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    a, b = torch.ones(2), torch.ones(3)
    out = scaler.scale([a, (b, [a])])
    assert torch.equal(out[0], a * 4) and torch.equal(out[1][0], b * 4) and torch.equal(out[1][1][0], a * 4)
    assert [t.sum().item() for t in scaler.scale(iter([a]))] == [8.0]


def test_update_with_new_scale() -> None:
    scaler = mixprec.GradScaler("cpu")
    _scaled_backward(scaler)
    scaler.update(128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(torch.tensor(64.0))
    assert scaler.get_scale() == 64.0
    with pytest.raises(ValueError, match="1-element tensor"):
        scaler.update(torch.ones(2))


# --- arguments and state dicts are checked, naming what is wrong ---------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init_scale": float("inf")}, ValueError, r"init_scale must be positive and finite .*got inf"),
        ({"init_scale": float("nan")}, ValueError, r"init_scale must be positive and finite .*got nan"),
        ({"init_scale": -2.0}, ValueError, r"init_scale must be positive and finite .*got -2.0"),
        ({"init_scale": "banana"}, TypeError, r"init_scale must be positive and finite .*got 'banana' \(str\)"),
        ({"init_scale": None}, TypeError, r"init_scale must be positive and finite .*got None \(NoneType\)"),
        ({"growth_factor": float("inf")}, ValueError, r"growth_factor must be > 1.0 and finite .*got inf"),
        ({"backoff_factor": float("nan")}, ValueError, r"backoff_factor must be in \(0, 1\) .*got nan"),
        ({"growth_interval": 2.5}, ValueError, r"growth_interval must be a positive number .*got 2.5 \(not an integer"),
        ({"growth_interval": "10"}, TypeError, r"growth_interval must be a positive number .*got '10' \(str\)"),
        ({"min_scale": float("inf")}, ValueError, r"min_scale must be positive and finite, or None .*got inf"),
        ({"max_scale": -1.0}, ValueError, r"max_scale must be positive, or None .*got -1.0"),
        ({"hysteresis": True}, TypeError, r"hysteresis must be >= 1 .*got True \(bool\)"),
        ({"fail_after": 1.5}, ValueError, r"fail_after must be a positive count or None, got 1.5"),
        ({"history": -1}, ValueError, r"history must be a count of scale changes, >= 0, got -1"),
        ({"on_event": "print"}, TypeError, r"on_event must be a callable"),
    ],
)
def test_bad_arguments_say_what_was_given_and_what_is_valid(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        mixprec.GradScaler("cpu", **kwargs)


def test_setters_check_their_values() -> None:
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"new_factor must be > 1.0 and finite .*got inf"):
        scaler.set_growth_factor(float("inf"))
    with pytest.raises(TypeError, match=r"new_interval must be a positive number of iterations.*\(str\)"):
        scaler.set_growth_interval("100")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"new_scale must be positive and finite .*got inf"):
        _scaled_backward(scaler)
        scaler.update(float("inf"))
    assert (scaler.get_growth_factor(), scaler.get_growth_interval(), scaler.get_scale()) == (2.0, 2000, 2.0**16)


def test_fail_fast_fires_when_the_scale_is_not_finite() -> None:
    # A tensor new_scale is not checked (that would sync): an infinite one skips every step, and
    # backing off cannot make it finite, so fail_after must fire although the scale is above the floor.
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, fail_after=3)
    _scaled_backward(scaler)
    scaler.update(torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match=r"the last 3 iterations all had inf/NaN.*scale is inf \(not finite\)"):
        _constant_run(scaler, lambda i: False, 10)


def test_fail_fast_fires_with_a_scale_set_by_hand() -> None:
    # Static scaling through update(new_scale): the skipped steps still count toward fail_after.
    scaler = mixprec.GradScaler("cpu", init_scale=1.0, fail_after=4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match=r"the last 4 iterations all had inf/NaN.*at its floor"):
        for _ in range(10):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y) * float("inf")).backward()
            scaler.step(opt)
            scaler.update(1.0)
    assert scaler.stats().consecutive_skipped == 4


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("scale", "banana", TypeError, r"state_dict\['scale'\] must be positive and finite .*got 'banana' \(str\)"),
        ("scale", None, TypeError, r"state_dict\['scale'\] must be positive and finite .*got None"),
        ("scale", float("inf"), ValueError, r"state_dict\['scale'\] must be positive and finite .*got inf"),
        ("growth_interval", -5, ValueError, r"state_dict\['growth_interval'\] must be a positive number .*got -5"),
        ("growth_interval", "10", TypeError, r"state_dict\['growth_interval'\] must be a positive number"),
        ("growth_factor", 0.5, ValueError, r"state_dict\['growth_factor'\] must be > 1.0"),
        ("backoff_factor", [0.5], TypeError, r"state_dict\['backoff_factor'\] must be in \(0, 1\)"),
        ("_growth_tracker", None, TypeError, r"state_dict\['_growth_tracker'\] must be a count"),
        ("_growth_tracker", -1, ValueError, r"state_dict\['_growth_tracker'\] must be a count"),
        ("min_scale", "x", TypeError, r"state_dict\['min_scale'\] must be positive and finite, or None"),
        ("max_scale", 0.0, ValueError, r"state_dict\['max_scale'\] must be positive, or None"),
        ("hysteresis", None, TypeError, r"state_dict\['hysteresis'\] must be >= 1"),
        ("_hysteresis_tracker", 0.5, ValueError, r"state_dict\['_hysteresis_tracker'\] must be an integer"),
        ("fail_after", 0, ValueError, r"state_dict\['fail_after'\] must be a positive count or None"),
        ("updates", -1, ValueError, r"state_dict\['updates'\] must be a count, >= 0"),
        ("consecutive_skipped", 2.5, ValueError, r"state_dict\['consecutive_skipped'\] must be a count"),
    ],
)
def test_load_state_dict_names_the_bad_key(key: str, value: Any, error: type[Exception], match: str) -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    before = scaler.state_dict()
    good = mixprec.GradScaler("cpu", min_scale=1.0, max_scale=2.0**20).state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict({**good, key: value})
    assert scaler.state_dict() == before  # checked before anything is loaded


def test_load_state_dict_checks_bounds_and_missing_keys() -> None:
    scaler = mixprec.GradScaler("cpu")
    good = scaler.state_dict()
    with pytest.raises(
        ValueError, match=r"state_dict\['min_scale'\] \(4.0\) must not exceed state_dict\['max_scale'\]"
    ):
        scaler.load_state_dict({**good, "min_scale": 4.0, "max_scale": 2.0})
    with pytest.raises(ValueError, match=r"missing \['scale'\]"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "scale"})
    with pytest.raises(TypeError, match="takes the dict from state_dict"):
        scaler.load_state_dict([("scale", 1.0)])  # type: ignore[arg-type]


# --- an exception inside optimizer.step() ----------------------------------------------


class _FailingStep:
    """An optimizer whose step raises while ``fail`` is set, as an out-of-memory error would."""

    fail = False

    def step(self, closure: Any = None) -> Any:
        if self.fail:
            raise RuntimeError("simulated failure inside optimizer.step()")
        return super().step(closure)  # type: ignore[misc]


class _FailingSGD(_FailingStep, torch.optim.SGD):
    pass


class _FailingAdamW(_FailingStep, torch.optim.AdamW):
    """Fused AdamW (it unscales by itself)."""


@pytest.mark.parametrize("update_after_failure", [False, True], ids=["no-update", "update"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_exception_in_optimizer_step_abandons_only_that_iteration(fused: bool, update_after_failure: bool) -> None:
    def optimizer(model: nn.Module, failing: bool) -> torch.optim.Optimizer:
        if fused:
            return (_FailingAdamW if failing else torch.optim.AdamW)(model.parameters(), lr=1e-2, fused=True)
        return (_FailingSGD if failing else torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)

    model, reference = _model(), _model()
    opt, ref_opt = optimizer(model, True), optimizer(reference, False)
    scaler, ref_scaler = _scaler("mixprec"), _scaler("torch")
    batches = _batches(9)
    x, y = batches[0]
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    opt.fail = True  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="simulated failure"):
        scaler.step(opt)
    opt.fail = False  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"raised an exception earlier in this iteration.*update\(\) after the"):
        scaler.step(opt)  # a retry: its gradients may be unscaled already
    if update_after_failure:
        scaler.update()  # optional: clears the iteration, the scale stays
    assert scaler.get_scale() == 2.0**10
    # The next iterations run as usual, and as torch's scaler runs the same batches.
    for i, (x, y) in enumerate(batches[1:], start=1):
        for s, m, o in ((scaler, model, opt), (ref_scaler, reference, ref_opt)):
            o.zero_grad()
            s.scale(_loss(m, x, y)).backward()
            _plant(list(m.parameters()), i)
            s.step(o)
            s.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert len({scaler.get_scale(), 2.0**10}) == 2, "the scale should have moved since"
    assert bitwise_equal(list(model.parameters()), list(reference.parameters()))
    assert scaler.stats().updates == 8
    pickle.dumps(scaler)


def test_failed_step_with_two_optimizers() -> None:
    # The other optimizer may still step in the abandoned iteration; the next scale() starts afresh.
    model0, model1 = _model(0), _model(1)
    opt0, opt1 = _FailingSGD(model0.parameters(), lr=0.1), torch.optim.SGD(model1.parameters(), lr=0.1)
    scaler = _scaler("mixprec")
    x, y = _batches(1)[0]
    for fail in (True, False):
        opt0.zero_grad()
        opt1.zero_grad()
        scaler.scale(_loss(model0, x, y) + _loss(model1, x, y)).backward()
        opt0.fail = fail
        if fail:
            with pytest.raises(RuntimeError, match="simulated failure"):
                scaler.step(opt0)
        else:
            scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
    assert scaler.stats().updates == 1


# --- torch's private members, for code written against torch.amp.GradScaler ----------------


def test_private_members_behave_as_torch() -> None:
    # tests/test_peer.py runs PyTorch's own tests for these; this keeps a check when that folder is absent.
    results = []
    for kind in ("torch", "mixprec"):
        scaler = _scaler(kind)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert scaler._per_optimizer_states["any"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        scaler.scale(_loss(model, *_batches(1)[0])).backward()
        _plant(list(model.parameters()), 1)
        found = scaler._unscale_grads_(opt, torch.full((1,), 0.25), torch.zeros(1), False)
        assert scaler._get_scale_async() is scaler._scale and scaler._growth_tracker is not None
        results.append((found, [p.grad for p in model.parameters()]))
        half = nn.Parameter(torch.ones(2, dtype=torch.float16))
        half.grad = torch.ones(2, dtype=torch.float16)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler._unscale_grads_(torch.optim.SGD([half], lr=0.1), torch.ones(1), torch.zeros(1), False)
    assert bitwise_equal(results[0], results[1])


def test_optimizer_taking_grad_scaler_gets_the_scaler() -> None:
    seen = []

    class Custom(torch.optim.SGD):
        def __init__(self, params: Any) -> None:
            super().__init__(params, lr=0.1)
            self._step_supports_amp_scaling = True

        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
            assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
            seen.append(grad_scaler)
            grad_scaler.unscale_(self)  # as torch's contract lets it: unscale and check by itself
            super().step(closure)

    model = _model()
    opt = Custom(model.parameters())
    scaler = _scaler("mixprec")
    scaler.scale(_loss(model, *_batches(1)[0])).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    scaler.update()
    assert seen == [scaler]
    assert scaler.skipped(opt) is False and scaler.stats().updates == 1
