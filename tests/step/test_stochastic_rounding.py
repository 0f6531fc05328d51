"""bf16-sr: stochastic rounding, its fused Adam, its seeds and counters, its optimizer hooks."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import mixprec
from helpers import bitwise_equal, one_step, regression_data, regression_model, requires_cuda
from mixprec._src.step import sr_kernel, sr_noise


def test_stochastic_rounding_is_unbiased() -> None:
    torch.manual_seed(0)
    x = torch.randn(64) * 3
    draws = torch.stack([mixprec.stochastic_round(x).float() for _ in range(4000)])
    ulp = (x.abs() * 2**-7).clamp_min(1e-30)
    assert ((draws.mean(0) - x).abs() / ulp).max() < 0.08  # a few percent of a bf16 step
    # Each draw is one of the two bf16 neighbours of x: the one below or above (x itself where exact).
    nearest, inf = x.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)
    below = torch.where(nearest.float() <= x, nearest.float(), torch.nextafter(nearest, -inf).float())
    above = torch.nextafter(below.to(torch.bfloat16), inf).float()
    assert ((draws == below) | (draws == above)).all()
    assert ((draws == below).any(0) & (draws == above).any(0)).float().mean() > 0.9  # both, for almost every x
    assert mixprec.stochastic_round(torch.tensor([float("inf"), -float("inf")])).isinf().all()
    with pytest.raises(TypeError, match="fp32"):
        mixprec.stochastic_round(torch.ones(2, dtype=torch.float16))


def test_weyl_noise_rounding_is_unbiased_over_steps() -> None:
    torch.manual_seed(0)
    x = torch.full((256,), 1.0 + 3 * 2**-10)  # 3/8 of the way from 1 to the next bf16 value
    steps = 2000
    seeds = [torch.tensor(sr_noise.tensor_seed(12345, step, 0), dtype=torch.int32) for step in range(steps)]
    draws = torch.stack([sr_noise.sr_bits(x, seed).view(torch.float32) for seed in seeds])
    assert set(draws.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert (draws.mean(0) - x).abs().max() < 0.06 * 2**-7  # every element, on average over steps
    # and within one step, about 3/8 of the elements round up
    assert abs(draws.gt(1.0).float().mean(1) - 0.375).max() < 0.1


def _noise_by_flat_position(shape: tuple[int, ...], device: str) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e3).to(device)
    seed = sr_noise.seed_tensor(-123456789, x.device)
    flat = sr_noise.sr_bits(x.reshape(-1), seed)
    index = torch.arange(x.numel(), dtype=torch.int64, device=device)
    noise = (((index * 0x9E3779B1 + (-123456789 & 0xFFFFFFFF)) & 0xFFFFFFFF) >> 16).to(torch.int32)  # no wrapping
    assert torch.equal(flat, (x.reshape(-1).view(torch.int32) + noise) & -(1 << 16))
    assert torch.equal(sr_noise.sr_bits(x, seed).reshape(-1), flat)
    torch._dynamo.reset()
    compiled = torch.compile(sr_noise.sr_bits, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, seed).reshape(-1), flat)


@pytest.mark.parametrize("shape", [(1000,), (7, 256), (3, 5, 64)])
def test_the_noise_is_that_of_each_elements_flat_position_whatever_the_shape(shape: tuple[int, ...]) -> None:
    """A (blocks, block) view rounds as its flat run: the per-dimension constants wrapped to 32 bits (which a
    Triton kernel needs) give the same noise as the flat position times the Weyl constant."""
    _noise_by_flat_position(shape, "cpu")


@requires_cuda
@pytest.mark.parametrize("shape", [(1000,), (7, 256), (4096, 256)])
def test_on_cuda_the_noise_is_that_of_each_elements_flat_position(shape: tuple[int, ...]) -> None:
    """Compiled for the GPU: a Triton kernel, whose index arithmetic is int32."""
    _noise_by_flat_position(shape, "cuda")


def test_fused_adam_sr_kernel_matches_its_eager_form() -> None:
    torch.manual_seed(0)
    p, g, m, v = (torch.randn(1000).mul(0.1).to(torch.bfloat16) for _ in range(4))
    v = v.abs()
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    seed = torch.tensor(sr_noise.tensor_seed(7, 1, 0), dtype=torch.int32)
    scalars = sr_kernel.adam_scalars(group, 3.0, True)
    eager = [t.clone() for t in (p, g, m, v)]
    sr_kernel.adam_sr_update(*eager, seed, scalars)
    compiled = [t.clone() for t in (p, g, m, v)]
    torch.compile(sr_kernel.adam_sr_update, fullgraph=True, dynamic=True)(*compiled, seed, scalars)
    assert not torch.equal(eager[0], p)
    assert torch.equal(compiled[0], eager[0])  # the same noise: the same rounding
    for got, want in zip(compiled[2:], eager[2:], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


class _OwnSGD(torch.optim.SGD):
    """An optimizer class from outside torch.optim: bf16-sr widens it in a step pre-hook."""


@pytest.mark.parametrize("cls", [torch.optim.SGD, _OwnSGD])
def test_bf16_pure_stalls_where_stochastic_rounding_converges(cls: type[torch.optim.SGD]) -> None:
    # A weight at 1.0 pulled towards 1.01 with a tiny learning rate: every update is far below half
    # a bf16 step (2**-8 at 1.0), so round-to-nearest throws each one away.
    results = {}
    for level in ("bf16-pure", "bf16-sr"):
        torch.manual_seed(0)
        model = nn.Linear(1, 256, bias=False)
        nn.init.ones_(model.weight)
        opt = cls(model.parameters(), lr=0.02)  # updates of about 4e-4 < 2**-8 / 2
        model, opt = mixprec.prepare(model, opt, level=level, output_dtype=torch.float32)
        x = torch.ones(1, 1)
        for _ in range(600):
            opt.zero_grad()
            F.mse_loss(model(x), torch.full((1, 256), 1.01), reduction="sum").backward()
            opt.step()
        results[level] = model.weight.float()
    assert torch.equal(results["bf16-pure"], torch.ones(256, 1))  # stalled
    assert (results["bf16-sr"].mean() - 1.0).item() > 0.006  # moved most of the way to 1.01


def test_bf16_sr_state_in_bf16_and_bytes() -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    o1 = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = mixprec.prepare(model, opt, level="bf16-sr")
    o1_opt = torch.optim.AdamW(o1.parameters())
    x = torch.randn(8, 256)
    for m, o in ((model, opt), (o1, o1_opt)):
        o.zero_grad()
        with mixprec.autocast("cpu"):
            m(x).float().square().mean().backward()
        o.step()
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert states and all(v.dtype is torch.bfloat16 for v in states)
    assert all(p.dtype is torch.bfloat16 and p.grad.dtype is torch.bfloat16 for p in model.parameters())  # type: ignore[union-attr]
    ratio = mixprec.state_bytes(model, opt) / mixprec.state_bytes(o1, o1_opt)
    assert ratio <= 0.55, ratio


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_fused_bf16_sr_adam_matches_torch_update(cls: type[torch.optim.Optimizer]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # start both from bf16-representable weights
        for p in (*model.parameters(), *reference.parameters()):
            p.copy_(p.to(torch.bfloat16))
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = cls(reference.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = mixprec.prepare(model, opt, level="bf16-sr", output_dtype=None)
    assert opt._mixprec.fused  # type: ignore[attr-defined]  # the compiled fused path is in use
    for step in range(1, 4):
        x = torch.randn(16, 64)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).float().square().mean().backward()
        with torch.no_grad():  # the same gradient for both: the bf16 model's, in fp32
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                q.grad = p.grad.float()  # type: ignore[union-attr]
        opt.step()
        ref_opt.step()
        with torch.no_grad():  # keep the reference on the bf16 model's weights: compare one step at a time
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                # Step 1 starts from the same (zero) state: within one bf16 step of torch's update. Later,
                # our bf16 moments (relative error 2**-9) shift updates of size ~lr by a fraction of lr.
                tolerance = q.abs() * 2**-7 + (0.0 if step == 1 else 5e-3 * 1e-2) + 1e-30
                assert ((p.float() - q).abs() <= tolerance).all(), step
                q.copy_(p.float())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert int(mine["step"]) == int(theirs["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].dtype is torch.bfloat16
            # bf16 storage: each step's rounding (2**-9 relative) carries into the next.
            scale = theirs[key].abs().max().item()
            torch.testing.assert_close(mine[key].float(), theirs[key], rtol=1e-2, atol=2**-8 * scale)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), id="AdamW-fused"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), id="SGD"),
    ],
)
def test_bf16_sr_checkpoint_resumes_bit_for_bit(make: Any) -> None:
    def fresh(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = regression_model(seed)
        return mixprec.prepare(model, make(model.parameters()), level="bf16-sr")

    def steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    batches = regression_data(12)
    straight = fresh(0)
    steps(*straight, batches)
    first = fresh(0)
    steps(*first, batches[:6])
    buffer = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[1].state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = fresh(7)  # another process: other weights, other seeds, torch's generators elsewhere
    resumed[0].load_state_dict(saved["model"])
    resumed[1].load_state_dict(saved["opt"])
    torch.manual_seed(1234)
    steps(*resumed, batches[6:])
    assert bitwise_equal(list(straight[0].parameters()), list(resumed[0].parameters()))
    assert bitwise_equal(straight[1].state_dict(), resumed[1].state_dict())
    assert not bitwise_equal(list(first[0].parameters()), list(resumed[0].parameters()))  # it did train on


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-pure"])
def test_a_checkpoint_loaded_before_prepare_resumes_bit_for_bit(level: str) -> None:
    # A bf16 run's checkpoint loaded into a plain fp32 model and optimizer (torch widens the state to the
    # parameters' fp32), then prepared: the optimizer state goes back to bf16, and training goes on as
    # the run that never stopped. (It stayed fp32 before: the saving lost, and the run drifted.)
    def steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = regression_model(0)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    batches = regression_data(8)
    straight = mixprec.prepare(*fresh(), level=level)
    steps(*straight, batches)
    first = mixprec.prepare(*fresh(), level=level)
    steps(*first, batches[:4])
    saved = copy.deepcopy({"model": first[0].state_dict(), "opt": first[1].state_dict()})
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = mixprec.prepare(model, opt, level=level)
    low = [st for p, st in opt.state.items() if p.dtype is torch.bfloat16]  # a kept norm's state stays fp32
    assert low and all(v.dtype is torch.bfloat16 for st in low for k, v in st.items() if k != "step")
    steps(*resumed, batches[4:])
    assert bitwise_equal(list(straight[0].parameters()), list(resumed[0].parameters()))


def _sr(cls: type[torch.optim.Optimizer]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = regression_model()
    model, opt = mixprec.prepare(model, cls(model.parameters(), lr=1e-2), level="bf16-sr")  # type: ignore[call-arg]
    assert opt._mixprec.fused is (cls is torch.optim.AdamW)  # type: ignore[attr-defined]
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    return [[p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())]


@pytest.mark.parametrize("norm", [False, True], ids=["all-bf16", "fp32-norm-kept"])
@pytest.mark.parametrize("created", ["before-prepare", "after-prepare"])
def test_bf16_sr_adam_with_lr_scheduler(created: str, norm: bool) -> None:
    model = regression_model(norm=norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)

    sched = schedule(opt) if created == "before-prepare" else None
    model, opt = mixprec.prepare(model, opt, level="bf16-sr")
    assert opt._mixprec.fused  # type: ignore[attr-defined]
    sched = sched or schedule(opt)
    start = _snapshot(model, opt)[0]
    one_step(model, opt)
    sched.step()  # warnings are errors: none about the order of step() calls
    first = _snapshot(model, opt)[0]
    assert all(not torch.equal(a, b) for a, b in zip(start, first, strict=True))  # lr 1e-2 moves every weight
    assert opt.param_groups[0]["lr"] == 0.0
    one_step(model, opt)
    sched.step()
    assert bitwise_equal(_snapshot(model, opt)[0], first)  # lr 0: nothing moves


# AdamW: the fused kernel; SGD: SGD's own step on fp32 copies.
SR_PATHS = [pytest.param(torch.optim.AdamW, id="AdamW-fused"), pytest.param(torch.optim.SGD, id="SGD")]


@pytest.mark.parametrize("cls", SR_PATHS)
def test_bf16_sr_runs_step_hooks_in_order(cls: type[torch.optim.Optimizer]) -> None:
    model, opt = _sr(cls)
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name: str) -> Any:
        return lambda *_: seen.append((name, model[0].weight.detach().clone()))

    handles = [opt.register_step_post_hook(hook("post")), opt.register_step_pre_hook(hook("pre")),
               register_optimizer_step_pre_hook(hook("global-pre"))]  # fmt: skip
    try:
        before = model[0].weight.detach().clone()
        one_step(model, opt)
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _ in seen] == ["global-pre", "pre", "post"]
    assert torch.equal(seen[0][1], before) and torch.equal(seen[1][1], before)
    assert not torch.equal(seen[2][1], before)  # the post hook sees the update


@pytest.mark.parametrize("cls", SR_PATHS)
def test_bf16_sr_raising_pre_hook_prevents_the_update(cls: type[torch.optim.Optimizer]) -> None:
    model, opt = _sr(cls)
    one_step(model, opt)

    def refuse(*_: Any) -> None:
        raise RuntimeError("refused by a pre-hook")

    handle = opt.register_step_pre_hook(refuse)
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="refused by a pre-hook"):
        one_step(model, opt)
    assert bitwise_equal(_snapshot(model, opt), before)
    handle.remove()
    one_step(model, opt)
    assert not bitwise_equal(_snapshot(model, opt)[0], before[0])


@pytest.mark.parametrize("cls", SR_PATHS)
def test_bf16_sr_step_aborted_by_a_pre_hook_leaves_the_optimizer_whole(cls: type[torch.optim.Optimizer]) -> None:
    # The next iteration (zero_grad, backward, step) must go on as if the aborted step never was.
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        return _sr(cls)

    def refuse(*_: Any) -> None:
        raise RuntimeError("refused by a pre-hook")

    model, opt = fresh()
    one_step(model, opt)
    handle = opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="refused by a pre-hook"):
        one_step(model, opt)
    handle.remove()
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    want_model, want_opt = fresh()
    one_step(want_model, want_opt)
    for m, o in ((model, opt), (want_model, want_opt)):
        x, y = regression_data(2)[1]
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    assert bitwise_equal(_snapshot(model, opt), _snapshot(want_model, want_opt))


def test_bf16_sr_pre_hook_clipping_model_parameters_clips_the_update() -> None:
    # A pre-hook is where some training loops clip; it must see the gradients SGD will step with.
    def run(clip_in_hook: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model, opt = _sr(torch.optim.SGD)

        def clip(*_: Any) -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)

        if clip_in_hook:
            opt.register_step_pre_hook(clip)
        x, y = regression_data(1)[0]
        F.mse_loss(model(x), y).backward()
        if not clip_in_hook:
            clip()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    assert bitwise_equal(run(clip_in_hook=True), run(clip_in_hook=False))


@pytest.mark.parametrize(
    ("make", "state"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), "fp32"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "fp32"),  # install_generic's step (on the CPU, SGD's list kernel)
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "8bit"),  # quantized state's own list step
    ],
)
def test_a_bf16_sr_step_refuses_cuda_graph_capture(make: Any, state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise comes from host integers a graph would replay: a step captured into a CUDA graph raises, and says
    what to do, before it writes anything (simulated on the CPU: torch's own check, which passes for capturable
    groups, left out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model, opt = mixprec.prepare(model, make(model.parameters()), level="bf16-sr", optimizer_state=state)
    F.mse_loss(model(torch.randn(8, 64)).float(), torch.randn(8, 4)).backward()
    opt.step()  # the state made (a quantized state's codes, step counts)
    F.mse_loss(model(torch.randn(8, 64)).float(), torch.randn(8, 4)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    held = copy.deepcopy(opt.state_dict())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.optim.Optimizer, "_cuda_graph_capture_health_check", lambda self: None)
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph.*outside the graph"):
        opt.step()
    assert bitwise_equal(before, [p.detach() for p in model.parameters()])
    assert bitwise_equal(held, opt.state_dict())  # nothing counted or written
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    opt.step()  # not capturing: steps
    assert not bitwise_equal(before, [p.detach() for p in model.parameters()])
