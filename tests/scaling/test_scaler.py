"""GradScaler against torch.amp.GradScaler, recipe by recipe, plus what torch's lacks."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import (
    HostSyncs,
    bitwise_equal,
    class_batches,
    fp16_loss,
    plant_overflow,
    scaled_backward,
    scaler_model,
    small_scaler,
    train_some,
)


def recipe_typical(kind: str) -> tuple[Any, ...]:
    model, scaler = scaler_model(), small_scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scales = []
    for i, (x, y) in enumerate(class_batches(12)):
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        plant_overflow(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters()), opt.state_dict()["state"]


def recipe_clipping(kind: str) -> tuple[Any, ...]:
    model, scaler = scaler_model(), small_scaler(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scales = []
    for i, (x, y) in enumerate(class_batches(12)):
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        plant_overflow(list(model.parameters()), i)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters()), opt.state_dict()["state"]


def recipe_gradient_penalty(kind: str) -> tuple[Any, ...]:
    model, scaler = scaler_model(), small_scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = []
    for i, (x, y) in enumerate(class_batches(10)):
        opt.zero_grad()
        loss = fp16_loss(model, x, y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        penalty = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled_grads]).sum().sqrt()
        scaler.scale(loss + penalty).backward()
        plant_overflow(list(model.parameters()), i)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters())


def recipe_two_losses_two_optimizers(kind: str) -> tuple[Any, ...]:
    model0, model1, scaler = scaler_model(0), scaler_model(1), small_scaler(kind)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.1)
    opt1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
    scales, skipped = [], []
    for i, (x, y) in enumerate(class_batches(12)):
        opt0.zero_grad()
        opt1.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out0, out1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * out0 + 3 * out1, F.one_hot(y, 4).float())
            loss1 = F.mse_loss(3 * out0 - 5 * out1, F.one_hot(y, 4).float())
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        plant_overflow(list(model1.parameters()), i)  # only optimizer 1 sees the bad values
        scaler.unscale_(opt0)
        r0 = scaler.step(opt0)
        r1 = scaler.step(opt1)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append((r0, r1))
    return scales, list(model0.parameters()), list(model1.parameters()), opt1.state_dict()["state"]


def recipe_accumulation(kind: str) -> tuple[Any, ...]:
    model, scaler = scaler_model(), small_scaler(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    batches = class_batches(24)
    for update in range(12):
        for x, y in batches[2 * update : 2 * update + 2]:
            scaler.scale(fp16_loss(model, x, y) / 2).backward()
        plant_overflow(list(model.parameters()), update)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, list(model.parameters())


def recipe_fused_adamw(kind: str) -> tuple[Any, ...]:
    model, scaler = scaler_model(), small_scaler(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scales = []
    for i, (x, y) in enumerate(class_batches(10)):
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        plant_overflow(list(model.parameters()), i)
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


# --- pickling ----------------------------------------------------------------------------


def test_pickle_refuses_mid_iteration_and_a_clone_trains_on_alike() -> None:
    model, scaler = scaler_model(), small_scaler("mixprec", hysteresis=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_some(scaler, model, opt, range(0, 5))
    x, y = class_batches(6)[5]
    opt.zero_grad()
    scaler.scale(fp16_loss(model, x, y)).backward()
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
    train_some(scaler, model, opt, range(6, 12))
    train_some(clone, twin, torch.optim.SGD(twin.parameters(), lr=0.1), range(6, 12))
    assert clone.state_dict() == scaler.state_dict()
    assert bitwise_equal(list(model.parameters()), list(twin.parameters()))


# --- misuse --------------------------------------------------------------------------


def test_misuse_raises_with_what_to_do() -> None:
    scaler = mixprec.GradScaler("cpu")
    _, opt = scaled_backward(scaler)
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
    model, opt = scaler_model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = class_batches(1)[0]
    before = copy.deepcopy(list(model.parameters()))
    assert scaler.backward(fp16_loss(model, x, y), opt) is False
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


def test_scheduler_does_not_advance_on_skipped_step() -> None:
    scaler = small_scaler("mixprec")
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for i, (x, y) in enumerate(class_batches(4)):
        opt.zero_grad()
        scaler.scale(fp16_loss(model, x, y)).backward()
        if i == 0:  # the first step is skipped: torch's scheduler would warn here
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        scaler.step_scheduler(sched)  # warnings are errors in this suite
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 0.5, 0.25, 0.125]


def test_fused_optimizer_step_does_not_sync(host_syncs: HostSyncs) -> None:
    scaler = small_scaler("mixprec")
    model = scaler_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    for x, y in class_batches(3):
        with host_syncs:  # scale, backward, step and update: no read of any tensor's data
            opt.zero_grad()
            scaler.scale(fp16_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert host_syncs.names() == []  # no found_inf.item(): the fused kernel reads found_inf itself
    assert scaler.skipped(opt) is False


def test_unfused_step_reads_the_flag_once_and_nothing_else_syncs(host_syncs: HostSyncs) -> None:
    scaler = small_scaler("mixprec")
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # no step tensor: SGD reads nothing itself
    x, y = class_batches(1)[0]
    with host_syncs:
        loss = scaler.scale(fp16_loss(model, x, y))
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
        model = scaler_model().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
        x, y = class_batches(1)[0]
        scaler.scale(F.cross_entropy(model(x.to(dtype)).float(), y)).backward()
        scaled = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        scaler.unscale_(opt)  # torch.amp.GradScaler raises "Attempting to unscale FP16 gradients."
        for p, g in zip(model.parameters(), scaled, strict=True):
            assert torch.equal(p.grad, (g.float() * (1 / 2.0**8)).to(dtype))  # fp32 math, one rounding


def test_megengine_automatic_style() -> None:
    scaler = small_scaler("mixprec")
    model = scaler_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = class_batches(1)[0]
    assert scaler.backward(fp16_loss(model, x, y), opt) is False
    assert scaler.stats().updates == 1
    opt.step()
    model.zero_grad()
    poisoned = fp16_loss(model, x, y) * float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.backward(poisoned, model.parameters()) is True
    assert all(p.grad is None for p in model.parameters())  # dropped: the step changes nothing
    opt.step()
    assert bitwise_equal(before, [p.detach() for p in model.parameters()])
    assert scaler.get_scale() == 2.0**9


def test_megengine_manual_style_matches_torch() -> None:
    results = []
    for style in ("torch", "manual"):
        model = scaler_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = small_scaler("torch" if style == "torch" else "mixprec")
        for i, (x, y) in enumerate(class_batches(8)):
            opt.zero_grad()
            if style == "torch":
                scaler.scale(fp16_loss(model, x, y)).backward()
                plant_overflow(list(model.parameters()), i)
                scaler.step(opt)
            else:
                fp16_loss(model, x, y).backward(gradient=torch.tensor(scaler.scale_factor))
                plant_overflow(list(model.parameters()), i)
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
    scaled_backward(scaler)
    scaler.update(128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(torch.tensor(64.0))
    assert scaler.get_scale() == 64.0
    with pytest.raises(ValueError, match="1-element tensor"):
        scaler.update(torch.ones(2))


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

    model, reference = scaler_model(), scaler_model()
    opt, ref_opt = optimizer(model, True), optimizer(reference, False)
    scaler, ref_scaler = small_scaler("mixprec"), small_scaler("torch")
    batches = class_batches(9)
    x, y = batches[0]
    opt.zero_grad()
    scaler.scale(fp16_loss(model, x, y)).backward()
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
            s.scale(fp16_loss(m, x, y)).backward()
            plant_overflow(list(m.parameters()), i)
            s.step(o)
            s.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert len({scaler.get_scale(), 2.0**10}) == 2, "the scale should have moved since"
    assert bitwise_equal(list(model.parameters()), list(reference.parameters()))
    assert scaler.stats().updates == 8
    pickle.dumps(scaler)


def test_failed_step_with_two_optimizers() -> None:
    # The other optimizer may still step in the abandoned iteration; the next scale() starts afresh.
    model0, model1 = scaler_model(0), scaler_model(1)
    opt0, opt1 = _FailingSGD(model0.parameters(), lr=0.1), torch.optim.SGD(model1.parameters(), lr=0.1)
    scaler = small_scaler("mixprec")
    x, y = class_batches(1)[0]
    for fail in (True, False):
        opt0.zero_grad()
        opt1.zero_grad()
        scaler.scale(fp16_loss(model0, x, y) + fp16_loss(model1, x, y)).backward()
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
        scaler = small_scaler(kind)
        model = scaler_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert scaler._per_optimizer_states["any"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        scaler.scale(fp16_loss(model, *class_batches(1)[0])).backward()
        plant_overflow(list(model.parameters()), 1)
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

    model = scaler_model()
    opt = Custom(model.parameters())
    scaler = small_scaler("mixprec")
    scaler.scale(fp16_loss(model, *class_batches(1)[0])).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    scaler.update()
    assert seen == [scaler]
    assert scaler.skipped(opt) is False and scaler.stats().updates == 1
