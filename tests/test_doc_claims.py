"""Behaviour the docs state in words, each pinned by a test that fails when the sentence stops being true.

Each test quotes its claim (file and words). The amaxes, scales and signals are computed here from
the tensors the layers see (hooks), not read back from the code under test.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from helpers import sqnr, square_loss
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.layers import plan as layer_plan
from mixprec._src.layers.choice import LayerChoice

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROLES = ("input", "weight", "grad_output")
FP8_MAX = {"input": torch.finfo(E4M3).max, "weight": torch.finfo(E4M3).max, "grad_output": torch.finfo(E5M2).max}


def _delayed_scale(amax: float, role: str) -> float:
    """Transformer Engine's scale for an amax, margin 0: fp8 max / amax (in fp64, then fp32)."""
    return float(torch.tensor(FP8_MAX[role] / amax, dtype=torch.float64).float())


class _AmaxProbe:
    """What each fp8 layer of a model is handed, call by call: its input, its weight and its output gradient."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.seen: dict[str, dict[str, list[float]]] = {}
        for name in names:
            self.seen[name] = {role: [] for role in ROLES}
            module = model.get_submodule(name)
            module.register_forward_pre_hook(self._pre(name))
            module.register_forward_hook(self._post(name))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = self.seen[name]
            seen["input"].append(float(args[0].detach().abs().amax()))
            seen["weight"].append(float(module.weight.detach().abs().amax()))  # the copy the layer computes with

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: self.seen[name]["grad_output"].append(float(g.detach().abs().amax())))

        return hook

    def take(self) -> dict[str, dict[str, float]]:
        """Per layer and role, the largest amax seen since the last take (and forget them)."""
        out = {}
        for name, seen in self.seen.items():
            assert all(seen[role] for role in ROLES), (name, seen)
            out[name] = {role: max(seen[role]) for role in ROLES}
            for role in ROLES:
                seen[role].clear()
        return out


def _fp8_mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return mixprec.prepare(model, opt, "O2", fp8=mixprec.Fp8Config("delayed", history_len=8))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize(
    "factors", [(1.0, 8.0), (8.0, 1.0), (2.0, 8.0, 1.0)], ids=["small-first", "large-first", "largest-in-the-middle"]
)
def test_delayed_scaling_records_the_max_of_a_steps_micro_batches(factors: tuple[float, ...], recompute: bool) -> None:
    """docs/fp8.md: "pending = max(pending, amax of the tensor now)   every forward and backward of step t";
    "Recording is a max, so activation checkpointing's recompute and gradient-accumulation micro-batches
    neither advance the history nor change the scales within a step; the history advances once per
    optimizer step"; "On the first step (an empty history) a tensor is scaled by its own amax."

    Micro-batches whose magnitudes differ 8x, the largest first, last or in the middle: the history
    entry of each step is the largest amax of its micro-batches (input, weight and output gradient),
    as the hooks saw them; the history moves by one entry per optimizer step and not before; the
    scales used within a step are those of the history before it, the same for every micro-batch.
    """
    model, opt = _fp8_mlp()
    names = ["0", "2"]  # the fp8 linears (the head, "4", stays out)
    assert mixprec.fp8_layers(model).converted == names  # type: ignore[union-attr]
    scalings = {n: model.get_submodule(n).fp8 for n in names}
    for s in scalings.values():
        s.recording = True  # the cast statistics: the scale each cast used (what Monitor(fp8_stats=True) reads)
    probe = _AmaxProbe(model, names)
    history: dict[str, dict[str, list[float]]] = {n: {r: [] for r in ROLES} for n in names}  # newest first
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        before = {n: s.history.clone() for n, s in scalings.items()}
        step_amax: dict[str, dict[str, list[float]]] = {n: {r: [] for r in ROLES} for n in names}
        for factor in factors:
            # bf16 values scaled by a power of two: the layers' bf16 cast of the input is exact
            x = torch.randn(16, 32, generator=g).bfloat16().float() * factor
            # checkpointed: the backward recomputes the forward, which sees the same amaxes again
            out = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
            (out.float().square().mean() / len(factors)).backward()
            seen = probe.take()
            for n, s in scalings.items():
                assert torch.equal(s.history, before[n]), (step, n)  # a micro-batch does not advance the history
                stats = s.stats
                for role in ROLES:
                    amax = seen[n][role]
                    step_amax[n][role].append(amax)
                    # the scale this micro-batch's cast used: from the history before the step, else its own amax
                    past = max(history[n][role], default=0.0)
                    expected = _delayed_scale(past if past > 0 else amax, role)
                    assert float(stats[role].scale) == expected, (step, factor, n, role)
        opt.step()
        opt.zero_grad()
        for n, s in scalings.items():
            for r, role in enumerate(ROLES):
                amaxes = step_amax[n][role]
                if role != "weight":  # the weight is one tensor within a step; the others differ by micro-batch
                    assert max(amaxes) > 1.5 * min(amaxes), (n, role, amaxes)
                history[n][role].insert(0, max(amaxes))
                assert s.history[r, : step + 1].tolist() == history[n][role], (step, n, role)
            assert torch.equal(s.history[:, 1:], before[n][:, :-1])  # one entry per optimizer step
            assert not s.pending.any()


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("option", [{"history_len": 16}, {"margin": 1}, {"amax_algo": "most_recent"}],
                         ids=["history_len", "margin", "amax_algo"])  # fmt: skip
def test_delayed_scaling_options_are_refused_with_a_dynamic_recipe(recipe: str, option: dict[str, object]) -> None:
    """docs/fp8.md: "`history_len`, `margin` and `amax_algo` are refused with any recipe but `delayed`,
    where they would do nothing"."""
    with pytest.raises(ValueError, match="use recipe 'delayed' with them"):
        mixprec.Fp8Config(recipe, **option)  # type: ignore[arg-type]
    assert mixprec.Fp8Config("delayed", **option)  # type: ignore[arg-type]


def test_an_evaluation_under_no_grad_uses_the_historys_scales() -> None:
    """docs/fp8.md: "A forward under `torch.no_grad()` (an evaluation) uses the scales and records nothing."

    After training on unit-sized inputs, an input 64x larger is cast with the scales of the history
    (it saturates), as a training forward would cast it, not with its own amax.
    """
    model, opt = _fp8_mlp()
    _train_steps(model, opt, 3)
    scaling = model.get_submodule("0").fp8
    history, pending = scaling.history.clone(), scaling.pending.clone()
    x = torch.randn(16, 32) * 64
    with torch.no_grad():
        evaluated = model(x)
    assert torch.equal(scaling.history, history) and torch.equal(scaling.pending, pending)  # recorded nothing
    trained = model(x)  # grad mode: the same scales (those of the history), and it records
    assert torch.equal(evaluated, trained.detach())
    assert scaling.pending[0] == float(x.bfloat16().abs().amax())


def test_only_the_optimizer_given_to_prepare_advances_the_history() -> None:
    """docs/fp8.md: "The history advances at the `step()` of the optimizer given to `prepare`; one built
    afterwards does not advance it"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    given = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, given = mixprec.prepare(model, given, "O1", fp8="delayed")
    other = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaling = model.get_submodule("0").fp8
    model(torch.randn(16, 32)).float().square().mean().backward()
    pending = scaling.pending.clone()
    assert pending.all()
    other.step()
    assert not scaling.history.any() and torch.equal(scaling.pending, pending)
    given.step()
    assert torch.equal(scaling.history[:, 0], pending) and not scaling.pending.any()


@pytest.mark.parametrize(
    ("capability", "refused"),
    [((8, 6), {"tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp"}), ((8, 9), {"rowwise", "rowwise_with_gw_hp"}),
     ((9, 0), set())],
    ids=["8.6", "8.9", "9.0"],
)  # fmt: skip
def test_gpus_without_fp8_gemms_are_refused(capability: tuple[int, int], refused: set[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """docs/fp8.md: "on CUDA, `prepare` refuses GPUs below compute capability 8.9 (9.0 for the rowwise recipes)".

    The check prepare runs before converting anything, on a model that says its parameters are on a
    GPU of the given capability (no GPU here).
    """
    on_gpu = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 0))]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for recipe in ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp"):
        if recipe in refused:
            with pytest.raises(ValueError, match="compute capability"):
                fp8_conversion.check_device(on_gpu, mixprec.Fp8Config(recipe))  # type: ignore[arg-type]
        else:
            fp8_conversion.check_device(on_gpu, mixprec.Fp8Config(recipe))  # type: ignore[arg-type]


class _WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.attn(x, x, x)[0]))


def test_attention_projections_are_converted_and_a_subclass_with_its_own_forward_is_left_out(
        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """docs/fp8.md: "Left out, and listed by `mixprec.fp8_layers(model)` (and logged on `mixprec.fp8` at
    INFO): ... a subclass with a forward of its own ... An `nn.MultiheadAttention`'s packed in-projection
    (`<attention>.in_proj`) and its `out_proj` are converted"."""

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 0.5

    model = _WithAttention()
    model.proj = Scaled(32, 32)
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", fp8="tensorwise")
    layers = mixprec.fp8_layers(model)
    assert layers is not None and layers.converted == ["attn.in_proj", "attn.out_proj"]
    assert "Scaled overrides Linear's forward" in dict(layers.skipped)["proj"]
    assert not hasattr(model.proj, "fp8") and hasattr(model.attn.out_proj, "fp8")
    logged = [r for r in caplog.records if r.name == "mixprec.fp8" and r.levelno == logging.INFO]
    assert logged and "2 layer(s) in fp8, 2 left out" in logged[0].getMessage()
    assert "proj: Scaled overrides Linear's forward" in logged[0].getMessage()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(F.gelu(self.inp(x))))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"])
def test_dynamic_recipes_add_nothing_to_the_state_dict_and_delayed_adds_two_buffers(recipe: str) -> None:
    """docs/fp8.md: "dynamic recipes add nothing to the state dict, `delayed` adds `fp8.history` and
    `fp8.pending` per layer"; "weights are saved at full precision"."""
    plain = set(_Net().state_dict())
    model = _Net()
    mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", fp8=recipe)
    model(torch.randn(4, 16)).float().sum().backward()  # the casts ran: every buffer they use exists
    converted = mixprec.fp8_layers(model).converted  # type: ignore[union-attr]
    assert converted == ["inp", "mlp.0", "mlp.2"]
    added = {f"{n}.fp8.{b}" for n in converted for b in ("history", "pending")} if recipe == "delayed" else set()
    state = model.state_dict()
    assert set(state) == plain | added
    assert all(state[k].dtype == torch.float32 for k in plain)


def test_rowwise_statistics_report_the_largest_row_amax_and_the_smallest_row_scale() -> None:
    """docs/fp8.md: "With rowwise scales, `amax` is the largest row amax and `scale` the smallest row scale."

    The rows of the input (tokens) and of the weight (output features) have amaxes 2**k apart; a row's
    scale is the power of two at or below e4m3's max over its amax.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = mixprec.prepare(model, opt, "O1", fp8="rowwise")
    with torch.no_grad():
        model[0].weight.mul_(torch.logspace(-3, 3, 32, base=2.0)[:, None])  # one scale per output row
    monitor = mixprec.Monitor(model, fp8_stats=True)
    x = torch.randn(16, 32).bfloat16().float() * torch.logspace(-4, 4, 16, base=2.0)[:, None]  # bf16-exact rows
    model(x).float().square().mean().backward()
    stats = monitor.fp8_stats()["0"]
    monitor.close()
    for role, t in (("input", x), ("weight", model[0].weight.detach())):
        row_amax = t.abs().amax(dim=1)
        row_scale = [2.0 ** math.floor(math.log2(torch.finfo(E4M3).max / float(a))) for a in row_amax]
        assert min(row_scale) < max(row_scale)  # the rows differ: largest/smallest is not any row's
        assert stats[role]["amax"] == float(row_amax.max()), role
        assert stats[role]["scale"] == min(row_scale), role


def test_a_plan_for_another_model_changes_nothing() -> None:
    """docs/per_layer.md: "`Recipe.apply` applies it (`set_layer_precision` for each layer whose choice is not
    what the rest of the recipe gives it, ..., after checking that every name is a layer of the model"."""
    model = _Net()
    plan = (LayerChoice("inp", "linear 16->64", {}, {}, "fp32", "why"),
            LayerChoice("blocks.0", "linear 64->64", {}, {}, "fp32", "why"))  # fmt: skip
    with pytest.raises(ValueError, match="per-layer plan does not fit this model"):
        mixprec.Recipe(dtype="bf16", layers=plan).apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mixprec.layer_precision(model, "inp") is None and "forward" not in model.inp.__dict__


# ----- the guard (docs/per_layer.md) -------------------------------------------------------------------


def test_the_guard_watches_convolutions() -> None:
    """docs/per_layer.md: "The guard probes each GEMM layer"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Flatten(), nn.Linear(48, 4))
    with torch.no_grad():
        model[0].weight.fill_(1e3)
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 4, 8), 10.0))  # the convolution's output: 12 x 1e3 x 10 = 120000, past fp16
    assert [(m.layer, m.from_, m.to, m.signal) for m in guard.step()] == [("0", "fp16", "bf16", "nonfinite_forward")]


class _Fork(nn.Module):
    """``a`` and ``b`` read the same input; ``b``'s own input gradient overflows fp16, ``a``'s does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.inp.weight.mul_(1e-3)
            self.inp.bias.zero_()
            self.b.weight.fill_(5e3)  # input gradient of b: 16 x 5e3 = 80000 per element, past fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.a(h).float().sum() + self.b(h).float().sum()


def test_the_guard_judges_a_layers_own_input_gradient_not_the_sum_a_shared_input_receives() -> None:
    """docs/per_layer.md: "of its output gradient and its own input gradient in the backward (an identity
    autograd node before the layer: the gradient of that layer alone, not the sum a shared input receives)".

    The shared input's gradient is inf (b's part); a's part is finite, and a is not blamed.
    """
    model = _Fork()
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8))
    assert torch.isfinite(loss)  # the forward is fine
    loss.backward()
    assert not torch.isfinite(model.inp.weight.grad).all()  # the sum at the shared input overflowed
    moves = guard.step()
    assert [(m.layer, m.signal) for m in moves] == [("b", "nonfinite_backward")], moves
    assert "input gradient inf/NaN from a finite output gradient" in moves[0].detail


def test_a_weight_gradient_overflow_from_finite_gradients_moves_the_layer() -> None:
    """docs/per_layer.md, `nonfinite_backward`: "a call of the layer made an inf/NaN input gradient from a
    finite output gradient (or its weight gradient is inf/NaN while its output gradients were finite)"."""
    model = nn.Sequential(nn.Linear(8, 16))
    with torch.no_grad():
        model[0].weight.fill_(1e-4)
    guard = mixprec.Guard(model, thresholds=mixprec.GuardThresholds(patience=1))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.full((4096, 8), 100.0))  # output 0.08; weight gradient 4096 x 100, past fp16
    out.float().sum().backward()
    assert torch.isfinite(out).all() and not torch.isfinite(model[0].weight.grad).all()
    (move,) = guard.step()
    assert (move.layer, move.to, move.signal) == ("0", "bf16", "nonfinite_backward")
    assert move.detail.startswith("weight gradient inf/NaN from a finite output gradient at loss scale 1")


def _fp8_guarded(thresholds: mixprec.GuardThresholds) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.Guard]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 16))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.prepare(model, opt, "O1", fp8="tensorwise")
    return model, opt, mixprec.Guard(model, thresholds=thresholds)


def _guarded_steps(model: nn.Module, opt: torch.optim.Optimizer, guard: mixprec.Guard, steps: range,
                   input_jump_at: int = -1, grad_jump_at: int = -1) -> list[mixprec.LayerMove]:  # fmt: skip
    moves = []
    for step in steps:
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step % 8))
        if step == input_jump_at:
            x[:, 31] = 1e3  # about 250x the input's amax so far
        loss = (model(x).float() - torch.sin(x[:, :16])).square().mean()
        (loss * (1e4 if step == grad_jump_at else 1.0)).backward()
        opt.step()
        opt.zero_grad()
        moves += guard.step()
    return moves


def test_an_amax_jump_counts_only_after_warmup() -> None:
    """docs/per_layer.md, `amax_jump`: "an fp8 layer's input or output-gradient amax over `amax_jump` times
    its peak so far, after `warmup` steps"."""
    thresholds = mixprec.GuardThresholds(amax_jump=50.0, warmup=5, patience=1)
    model, opt, guard = _fp8_guarded(thresholds)
    assert _guarded_steps(model, opt, guard, range(10), input_jump_at=3) == []  # guard.step() 4: in the warmup
    model, opt, guard = _fp8_guarded(thresholds)
    moves = _guarded_steps(model, opt, guard, range(10), input_jump_at=7)  # guard.step() 8: after it
    assert [(m.step, m.layer, m.signal) for m in moves] == [(8, "0", "amax_jump")], moves


def test_an_output_gradient_amax_jump_moves_the_layers_and_their_peaks_start_over() -> None:
    """docs/per_layer.md: `amax_jump` is "an fp8 layer's input or output-gradient amax over `amax_jump` times
    its peak so far"; "at `patience` (2) strikes in a row it moves one rung up the ladder and its strikes
    and peaks start over"."""
    model, opt, guard = _fp8_guarded(mixprec.GuardThresholds(amax_jump=50.0, warmup=5, patience=1))
    assert _guarded_steps(model, opt, guard, range(8)) == []
    peak = guard.state_dict()["peaks"]["0"][0]  # layer 0's largest input amax of steps 0-7
    moves = _guarded_steps(model, opt, guard, range(8, 9), grad_jump_at=8)  # the loss 1e4 x: every output gradient
    assert [(m.step, m.layer, m.to, m.signal) for m in moves] == [
        (9, "0", "fp8-rowwise", "amax_jump"),
        (9, "3", "fp8-rowwise", "amax_jump"),
    ], moves
    assert all("output gradient amax" in m.detail for m in moves)
    state = guard.state_dict()
    assert state["peaks"]["0"] == state["peaks"]["3"] == [0.0, 0.0] and state["peaks"]["5"][0] > 0
    assert state["strikes"] == {"0": 0, "3": 0, "5": 0}
    assert _guarded_steps(model, opt, guard, range(9, 10)) == []
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(9 % 8))  # that step's input
    assert guard.state_dict()["peaks"]["0"][0] == float(x.abs().amax()) < peak  # the peak counts from the move on


def test_the_default_ladder_is_the_documented_one() -> None:
    """docs/per_layer.md: "nvfp4 -> mxfp8 -> fp8-tensorwise -> fp8-rowwise -> bf16 -> fp32", "fp8-delayed ->
    fp8-tensorwise", "fp16 -> bf16 -> fp32"."""
    ladder = mixprec.GuardThresholds().ladder

    def climb(start: str) -> list[str]:
        rungs = [start]
        while rungs[-1] in ladder:
            rungs.append(ladder[rungs[-1]])
        return rungs

    assert climb("nvfp4") == ["nvfp4", "mxfp8", "fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"]
    assert climb("fp8-delayed") == ["fp8-delayed", "fp8-tensorwise", "fp8-rowwise", "bf16", "fp32"]
    assert climb("fp16") == ["fp16", "bf16", "fp32"]


class _Bf16Exact(nn.Module):
    """Rounds its input to bf16 values (in fp32): the next layer's input is exact in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float()


def test_the_plans_sqnr_is_the_worst_of_the_output_and_both_gradients() -> None:
    """docs/per_layer.md: "SQNR   of its output, input gradient and weight gradient against fp32, from the
    same weights, input and output gradient: the worst of the three".

    The measured layer's input and weight are exact in bf16, so its bf16 output is off by one rounding
    and its gradients (from an output gradient that is not exact) by more: the worst is not the output.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _Bf16Exact(), nn.Linear(64, 32))
    with torch.no_grad():
        model[2].weight.copy_(model[2].weight.bfloat16().float())
    x = torch.randn(48, 16)
    measured, _ = layer_plan.measure(model, x, square_loss, ["bf16"], time.perf_counter() + 60)
    (layer,) = [m for m in measured if m.name == "2"]
    h = model[1](model[0](x)).detach()
    out = model[2](h)
    (grad,) = torch.autograd.grad(square_loss(out), out)

    def run(precision: str | None) -> list[torch.Tensor]:
        holder = nn.Module()
        holder.layer = copy.deepcopy(model[2])
        mixprec.set_layer_precision(holder, "layer", precision)
        hi = h.clone().requires_grad_()
        o = holder.layer(hi)
        o.backward(grad.to(o.dtype))
        return [o.detach().float(), holder.layer.weight.grad.float(), hi.grad.float()]

    output, weight_grad, input_grad = (sqnr(a, b) for a, b in zip(run("bf16"), run(None), strict=True))
    assert output > min(weight_grad, input_grad) + 1.0, (output, weight_grad, input_grad)  # the output is not the worst
    assert layer.sqnr_db["bf16"] == pytest.approx(min(output, weight_grad, input_grad), abs=1e-6)
