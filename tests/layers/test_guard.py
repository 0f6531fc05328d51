"""The training guard: a planted outlier layer is found, moved up alone, training recovers, resume is bitwise."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import bitwise_equal, load_script
from mixprec._src.layers.ladder import LADDER

scenario = load_script("benchmarks/guard_outlier.py")
OUTLIER_AT, STEPS, _Run, _net = scenario.OUTLIER_AT, scenario.STEPS, scenario.Run, scenario.make_model


@pytest.fixture(scope="module")
def runs() -> dict[str, _Run]:
    return {
        "fp32": _Run(torch.float32, guarded=False).train(0, STEPS),
        "fp16": _Run(torch.float16, guarded=False).train(0, STEPS),
        "guarded": _Run(torch.float16, guarded=True).train(0, STEPS),
    }


def test_without_the_guard_the_outlier_collapses_the_loss_scale(runs: dict[str, _Run]) -> None:
    unguarded = runs["fp16"]
    assert unguarded.skipped >= STEPS - OUTLIER_AT  # every step from the outlier on
    assert unguarded.scaler.get_scale() < 1e-20  # halved at each of them
    assert not math.isfinite(unguarded.final())


def test_the_guard_moves_only_the_outlier_layer_within_two_steps(runs: dict[str, _Run]) -> None:
    guard = runs["guarded"].guard
    assert guard is not None and len(guard.moves) == 1, guard.moves
    move = guard.moves[0]
    # guard.step() counts from 1: the outlier's first step is step OUTLIER_AT + 1; patience is 2
    assert (move.layer, move.from_, move.to, move.signal) == ("0", "fp16", "bf16", "nonfinite_forward")
    assert move.step == OUTLIER_AT + 2, move
    assert mixprec.layer_precision(runs["guarded"].model, "0") == "bf16"
    assert guard.precisions() == {"0": "bf16", "3": "fp16", "6": "fp16"}


def test_the_guarded_run_ends_within_one_percent_of_fp32_at_a_healthy_scale(runs: dict[str, _Run]) -> None:
    guarded, fp32 = runs["guarded"], runs["fp32"]
    assert abs(guarded.final() - fp32.final()) / fp32.final() < 0.01, (guarded.final(), fp32.final())
    assert guarded.skipped == 2  # the two steps the guard needed
    assert guarded.scaler.get_scale() >= 2.0**13


@pytest.mark.parametrize("guard_first", [True, False])
def test_resume_after_the_move_is_bitwise(guard_first: bool) -> None:
    resume_at = OUTLIER_AT + 20
    original = _Run(torch.float16, guarded=True).train(0, resume_at)
    saved = original.state()
    original.train(resume_at, resume_at + 30)
    resumed = _Run(torch.float16, guarded=True)
    assert resumed.guard is not None and mixprec.layer_precision(resumed.model, "0") is None
    if guard_first:
        resumed.guard.load_state_dict(saved["guard"])
    resumed.model.load_state_dict(saved["model"])
    if not guard_first:
        resumed.guard.load_state_dict(saved["guard"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.scaler.load_state_dict(saved["scaler"])
    resumed.schedule.load_state_dict(saved["schedule"])
    assert mixprec.layer_precision(resumed.model, "0") == "bf16"  # the move replayed
    resumed.train(resume_at, resume_at + 30)
    assert resumed.losses == original.losses[resume_at:]
    assert bitwise_equal(dict(resumed.model.state_dict()), dict(original.model.state_dict()))
    assert resumed.guard.state_dict() == original.guard.state_dict()  # type: ignore[union-attr]


def test_moves_are_logged_and_called_back(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[mixprec.LayerMove] = []
    with caplog.at_level(logging.WARNING, logger="mixprec.guard"):
        _Run(torch.float16, guarded=True, callback=seen.append).train(OUTLIER_AT - 2, OUTLIER_AT + 3)
    assert len(seen) == 1 and str(seen[0]) in caplog.text
    assert "0 fp16 -> bf16 (nonfinite_forward: output inf/NaN from a finite input" in caplog.text


def _backward_overflow(init_scale: float, loss_factor: float, compiled: bool = False) -> tuple[mixprec.Guard, int]:
    """Layer 2's input gradient is 64 x 40 x its output gradient: past fp16 at a scaled output gradient of 26."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[2].weight.fill_(40.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = mixprec.GradScaler("cpu", init_scale=init_scale, fail_after=None)
    guard = mixprec.Guard(model, scaler, thresholds=mixprec.GuardThresholds(patience=1))
    # compiled whole: fullgraph=True raises at any graph break, so the probes are in the graph
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    backoffs = 0
    for _ in range(4):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):  # (an input that requires grad: layer 0's is probed)
            out = run(torch.randn(32, 16, requires_grad=True))
        scaler.scale((out.float() * loss_factor).sum()).backward()
        scaler.step(optimizer)
        before = scaler.get_scale()
        scaler.update()
        backoffs += scaler.get_scale() < before
        if guard.step():
            break
    return guard, backoffs


def test_a_backward_overflow_at_a_high_loss_scale_is_the_scalers_to_fix() -> None:
    # At scale 2**16 the scaled output gradient is 60: layer 2's input gradient (and then layer 0's weight
    # gradient) overflow until the scaler has backed off enough. No layer moves.
    guard, backoffs = _backward_overflow(2.0**16, 60.0 / 2**16)
    assert backoffs >= 2 and guard.moves == []


COMPILED = pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # Dynamo's own


@COMPILED
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_whose_backward_overflows_unscaled_moves(compiled: bool) -> None:
    torch._dynamo.reset()
    guard, _ = _backward_overflow(1.0, 60.0, compiled)
    assert [(m.layer, m.signal, m.to) for m in guard.moves] == [("2", "nonfinite_backward", "bf16")], guard.moves
    assert "input gradient inf/NaN from a finite output gradient at loss scale 1" in guard.moves[0].detail


@COMPILED
def test_a_compiled_guard_reads_what_an_eager_one_reads() -> None:
    # The probes run inside the compiled graph (forward and backward), with no graph break: a step's
    # readings are eager's, bit for bit, and the graph is made once.
    from torch._dynamo.testing import CompileCounterWithBackend

    readings = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _net()
        guard = mixprec.Guard(model)
        counter = CompileCounterWithBackend("aot_eager")
        run = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
        steps = []
        for step in range(3):
            x, y = scenario.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (run(x.requires_grad_()).float() - y).square().mean()
            loss.backward()
            model.zero_grad()
            steps.append(guard._read())
        readings.append(steps)
        assert counter.frame_count == (1 if compiled else 0)
    assert readings[0][0][0][0] > 0  # something was read
    assert readings[1] == readings[0]


def test_an_fp16_layer_near_overflow_moves_before_it_overflows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    with torch.no_grad():
        model[0].weight[:, 0] = 1.0
    x = torch.randn(8, 16)
    x[:, 0] = 4e4  # layer 0's output amax about 40000: finite in fp16, past half its range
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert torch.isfinite(out).all()  # (a backward would overflow the weight gradient: another signal)
    (move,) = guard.step()
    assert (move.layer, move.signal, move.to) == ("0", "fp16_overflow", "bf16")


def _fp8_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 16))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, optimizer


def _growing(step: int, grow_at: int = 20) -> float | None:
    """A feature of layer 0's input that grows 3x a step from ``grow_at``: delayed scales lag behind it."""
    return 10 * 3.0 ** min(step - grow_at, 6) if step >= grow_at else None


def _fp8_train(model: nn.Module, optimizer: torch.optim.Optimizer, guard: mixprec.Guard, steps: int,
               outlier: Callable[[int], float | None] = _growing) -> None:  # fmt: skip
    for step in range(steps):
        g = torch.Generator().manual_seed(step % 8)
        x = torch.randn(32, 32, generator=g)
        value = outlier(step)
        if value is not None:
            x[:, 31] = value
        optimizer.zero_grad()
        (model(x).float() - torch.sin(x[:, :16])).square().mean().backward()
        optimizer.step()
        guard.step()


def test_delayed_fp8_saturating_under_growing_activations_moves_to_tensorwise() -> None:
    model, optimizer = _fp8_net()
    model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8="delayed")
    guard = mixprec.Guard(model)
    _fp8_train(model, optimizer, guard, steps=30)
    assert [(m.layer, m.from_, m.to, m.signal) for m in guard.moves] == [
        ("0", "fp8-delayed", "fp8-tensorwise", "saturated")], guard.moves  # fmt: skip
    assert guard.moves[0].step == 22  # growth from step 21: two saturated steps
    assert guard.precisions() == {"0": "fp8-tensorwise", "3": "fp8-delayed", "5": "bf16"}
    layers = mixprec.fp8_layers(model)
    assert layers is not None and sorted(layers.converted) == ["0", "3"]
    assert "0.fp8.history" not in model.state_dict() and "3.fp8.history" in model.state_dict()


def test_an_fp8_amax_jump_after_warmup_moves_the_layer() -> None:
    model, optimizer = _fp8_net()
    model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8="tensorwise")
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(amax_jump=50.0, warmup=5, patience=1))
    _fp8_train(model, optimizer, guard, steps=12, outlier=lambda step: 1e3 if step >= 10 else None)  # ~250x its peak
    assert [(m.layer, m.to, m.signal) for m in guard.moves] == [("0", "fp8-rowwise", "amax_jump")], guard.moves
    assert guard.moves[0].step == 11 and "input amax" in guard.moves[0].detail


def test_an_fp8_cast_that_flushes_most_values_moves_the_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    mixprec.set_layer_precision(model, "0", "fp8-tensorwise")
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    x = torch.full((16, 32), 1e-4)
    x[0, 0] = 1e4  # one outlier: every other value falls below e4m3's smallest step after the tensor's scale
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    (move,) = guard.step()
    assert (move.layer, move.from_, move.to, move.signal) == ("0", "fp8-tensorwise", "fp8-rowwise", "flushed")


def test_a_layer_at_the_top_of_its_ladder_stays() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1e38)
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    model(torch.full((2, 4), 10.0))  # fp32 overflows: nothing to move to
    assert guard.step() == [] and guard.precisions() == {"0": "fp32"}


def test_healthy_training_moves_nothing_and_a_step_syncs_once() -> None:
    from helpers import HostSyncs

    model, optimizer = _fp8_net()
    model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8="delayed")
    guard = mixprec.Guard(model)
    _fp8_train(model, optimizer, guard, steps=12, outlier=lambda step: None)
    assert guard.moves == [] and all(s == 0 for s in guard.strikes.values())
    x = torch.randn(32, 32)
    with HostSyncs() as syncs:
        model(x).float().sum().backward()
        guard.step()
    assert syncs.names() == ["tolist"]


def test_thresholds_are_data_and_checked() -> None:
    th = mixprec.GuardThresholds(ladder={"fp16": "fp32", torch.bfloat16: "fp32"})
    assert th.ladder == {"fp16": "fp32", "bf16": "fp32"} and th.to_dict()["ladder"] == th.ladder
    assert mixprec.GuardThresholds().ladder == LADDER
    with pytest.raises(ValueError, match="patience"):
        mixprec.GuardThresholds(patience=0)
    with pytest.raises(ValueError, match=r"saturated must be a number in \(0, 1\]"):
        mixprec.GuardThresholds(saturated=2)
    with pytest.raises(ValueError, match=r"amax_jump must be a number in \(1, inf\]"):
        mixprec.GuardThresholds(amax_jump=0.5)
    with pytest.raises(ValueError, match="goes round from bf16 back to bf16"):
        mixprec.GuardThresholds(ladder={"bf16": "bf16"})
    with pytest.raises(ValueError, match="goes round from fp16 back to fp16"):
        mixprec.GuardThresholds(ladder={"fp16": "bf16", "bf16": "fp16"})
    for down in ({"fp32": "bf16"}, {"fp16": "fp8-tensorwise"}, {"fp8-tensorwise": "fp8-delayed"}):
        with pytest.raises(ValueError, match="a rung goes up"):
            mixprec.GuardThresholds(ladder=down)
    with pytest.raises(TypeError, match="GuardThresholds"):
        mixprec.Guard(_net(), thresholds={"patience": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler is the run's GradScaler"):
        mixprec.Guard(_net(), 3)
    with pytest.raises(ValueError, match="patience"):
        mixprec.GuardThresholds(patience=True)
    with pytest.raises(TypeError, match="callback must be callable"):
        mixprec.Guard(_net(), callback=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"watches an nn\.Module"):
        mixprec.Guard("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"names \['zzz'\] match no GEMM layer"):
        mixprec.Guard(_net(), names=("0", "zzz"))
    with pytest.raises(ValueError, match="unknown layer precision"):
        mixprec.GuardThresholds(ladder={"fp4": "bf16"})
    with pytest.raises(ValueError, match=r"no GEMM layer .* to watch"):
        mixprec.Guard(nn.Sequential(nn.LayerNorm(4)))
    guard = mixprec.Guard(_net(), names="6")
    assert list(guard.layers) == ["6"]
    other = mixprec.Guard(_net())
    with pytest.raises(ValueError, match="watches layers this guard does not"):
        guard.load_state_dict(other.state_dict())


def test_close_removes_the_probes() -> None:
    model = _net()
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    guard = mixprec.Guard(model)
    guard.close()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == before
    with pytest.raises(RuntimeError, match="this guard is closed"):
        guard.step()


def test_a_nan_input_is_not_a_layers_failure() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), float("nan")))
    assert guard.step() == [] and guard.strikes == {"0": 0, "1": 0}


def test_strikes_must_come_in_a_row() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[:, 0] = 1.0
    guard = mixprec.Guard(model)  # patience 2
    for near_overflow in (True, False, True, False, True):
        x = torch.randn(8, 16)
        x[:, 0] = 4e4 if near_overflow else 1.0
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
        assert guard.step() == []
    assert guard.strikes["0"] == 1


def _guard_worker(rank: int, world: int, port: int, results: Any, wrap: str) -> None:
    """Two ranks train one model (``wrap``: ``"ddp"`` or ``"fsdp"``); only rank 1's batches carry the outlier."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from helpers import init_process_group

    init_process_group(rank, world, port)
    model: nn.Module = _net()
    if wrap == "ddp":
        model = DistributedDataParallel(model)
    else:
        for layer in (model[0], model[3], model[6]):
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = mixprec.GradScaler("cpu", fail_after=None)
    guard = mixprec.Guard(model, scaler)
    for step in range(12):
        x, y = scenario.batch(step + 16 * rank, outlier_at=10**9)
        if rank == 1 and step >= 6:
            x = x * 3e4
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() - y).square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        guard.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) if wrap == "ddp" else None
    results[rank] = {"moves": [str(m) for m in guard.moves], "precision": guard.precisions(), "params": flat,
                     "loss": float(loss)}  # fmt: skip
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_every_rank_moves_the_same_layer_at_the_same_step() -> None:
    from helpers import spawn

    ranks = spawn(_guard_worker, 2, "ddp")
    assert ranks[0]["moves"] == ranks[1]["moves"] and len(ranks[0]["moves"]) == 1, ranks[0]["moves"]
    assert ranks[0]["moves"][0].startswith("step 8: module.0 fp16 -> bf16 (nonfinite_forward")
    assert ranks[0]["precision"] == ranks[1]["precision"]
    assert bitwise_equal(ranks[0]["params"], ranks[1]["params"])  # the replicas stayed one model


class _Twice(nn.Module):
    """``shared`` is called twice per forward; with ``boost`` its first call overflows fp16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, boost: float = 1.0) -> torch.Tensor:
        h = self.norm(self.inp(x)).float() * boost
        h = self.norm(self.shared(h)).float()  # first call: inf in fp16 when boosted
        return self.head(self.norm(self.shared(h)))  # second call: its input is already NaN then


@COMPILED
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_called_twice_is_judged_call_by_call(compiled: bool) -> None:
    torch._dynamo.reset()
    model = _Twice()
    guard = mixprec.Guard(model)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            run(torch.randn(4, 8), boost=1e6)
        guard.step()
    assert [(m.layer, m.signal) for m in guard.moves] == [("shared", "nonfinite_forward")], guard.moves


@pytest.mark.slow
def test_under_fsdp2_every_rank_moves_the_same_layer() -> None:
    from helpers import spawn

    ranks = spawn(_guard_worker, 2, "fsdp")
    assert ranks[0]["moves"] == ranks[1]["moves"] and len(ranks[0]["moves"]) == 1, ranks
    assert ranks[0]["moves"][0].startswith("step 8: 0 fp16 -> bf16 (nonfinite_forward")
    assert math.isfinite(ranks[0]["loss"]) and math.isfinite(ranks[1]["loss"])


def test_a_weight_gradient_made_from_a_nan_input_is_not_the_layers() -> None:
    # Without a scaler (scale 1): layer 0's fp16 output overflows; the layers after it get NaN inputs, so their
    # weight gradients are NaN from finite output gradients (a sum's gradient is 1 whatever the output).
    # Only layer 0 is at fault.
    model = _net()
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    x, _ = scenario.batch(OUTLIER_AT)
    with torch.autocast("cpu", dtype=torch.float16):
        model(x).float().sum().backward()
    assert not torch.isfinite(model[6].weight.grad).all()
    assert [(m.layer, m.signal) for m in guard.step()] == [("0", "nonfinite_forward")]


@pytest.mark.slow
# Dynamo reads .grad of the probe's output (a graph input, not a leaf) when it traces the layer after it.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:bf16 and fp16 are mixed in the scheduler node:UserWarning")  # inductor's note
@COMPILED
def test_the_guard_works_under_torch_compile() -> None:
    # a layer moved out of fp16 gets gradients in its new precision when compiled too, with torch's default
    # backward autocast (which, left to itself, would trace them in the region's fp16: pytorch#153044)
    _guard_under_compile()


def _guard_under_compile() -> None:
    torch._dynamo.reset()
    model = _net()
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    compiled = torch.compile(model)
    for step in (0, OUTLIER_AT, OUTLIER_AT + 1):
        x, y = scenario.batch(step)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (compiled(x).float() - y).square().mean()
        loss.backward()
        guard.step()
    assert [(m.layer, m.signal, m.step) for m in guard.moves] == [("0", "nonfinite_forward", 2)]
    assert math.isfinite(float(loss.detach()))  # the step after the move ran layer 0 in bf16, recompiled
    torch._dynamo.reset()


@COMPILED
def test_a_guard_made_after_the_model_ran_compiled_says_so() -> None:
    # torch.compile does not guard on module hooks by default: a graph made before the guard runs on
    # without its probes. The step says so instead of reading nothing; after a reset the probes are traced.
    torch._dynamo.reset()
    model = _net()
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, _ = scenario.batch(0)
    run(x).float().sum().backward()
    guard = mixprec.Guard(model)
    run(x).float().sum().backward()
    with pytest.raises(RuntimeError, match="make the guard before the first compiled call"):
        guard.step()
    torch.compiler.reset()
    run(x).float().sum().backward()
    assert guard.step() == [] and guard._seen  # the layers' calls were seen
    torch._dynamo.reset()


def _planted_run(fp8: mixprec.Fp8Config | None, guarded: bool) -> tuple[list[float], list[Any]]:
    """Layer "2"'s weight [0, 0] grows 10x a step for seven steps (to 1e7 times its size), then stays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.prepare(model, opt, "O1", fp8=fp8)
    guard = mixprec.Guard(model) if guarded else None
    losses = []
    for step in range(60):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step % 8))
        opt.zero_grad()
        loss = (model(x).float() - torch.sin(x[:, :16])).square().mean()
        loss.backward()
        opt.step()
        if 5 <= step < 12:
            with torch.no_grad():
                model[2].weight[0, 0] *= 10.0
        if guard is not None:
            guard.step()
        losses.append(loss.item())
    return losses, [] if guard is None else guard.moves


def test_an_nvfp4_layer_whose_weight_grows_an_outlier_moves_to_mxfp8() -> None:
    # NVFP4's tensor scale follows the outlier; the other blocks' e4m3 scales fall below e4m3's smallest and
    # their values flush to zero. MXFP8's power-of-two scale per 32 values holds the outlier in its own block.
    nvfp4 = mixprec.Fp8Config("nvfp4", keep_last=0.0)
    bf16, _ = _planted_run(None, False)
    unguarded, _ = _planted_run(nvfp4, False)
    guarded, moves = _planted_run(nvfp4, True)
    assert [(m.layer, m.from_, m.to, m.signal) for m in moves] == [("2", "nvfp4", "mxfp8", "flushed")], moves
    assert moves[0].step <= 15  # two flushed steps once the outlier is 1e6-1e7 times the rest
    assert all(math.isfinite(v) for v in guarded)
    tail = slice(-8, None)
    gap = [abs(sum(run[tail]) - sum(bf16[tail])) for run in (guarded, unguarded)]
    assert gap[0] < 0.6 * gap[1], (gap, sum(bf16[tail]) / 8)


def test_the_default_ladder_climbs_from_nvfp4_through_mxfp8_and_fp8() -> None:
    at, path = mixprec.LayerPrecision.NVFP4, []
    while at in mixprec.GuardThresholds().ladder:
        at = mixprec.GuardThresholds().ladder[at]
        path.append(at)
    assert path == ["mxfp8", "fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"]
    with pytest.raises(ValueError, match="down to nvfp4"):
        mixprec.GuardThresholds(ladder={"fp8-tensorwise": "nvfp4"})
    with pytest.raises(ValueError, match="down to mxfp8"):
        mixprec.GuardThresholds(ladder={"fp8-rowwise": "mxfp8"})
