"""bf16-sr's and bf16-kahan's multi-tensor CPU step: bitwise the per-tensor compiled kernels it replaces, one call a
group whatever the form of the user's AdamW, no host reads, and runs under a dispatch mode."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mixprec
from helpers import OpNames, step_ops_at, with_and_without_step_copies
from mixprec._src.optim import cpu_lists
from mixprec._src.prepare.levels import prepared_state
from mixprec._src.step import kahan, sr_kernel, stochastic_rounding
from mixprec.bench import step_cost
from mixprec.bench.workloads import TinyLM

pytestmark = pytest.mark.skipif(not cpu_lists.available(), reason="no C++ toolchain for the CPU kernel")

SIZES = (1, 7, 16, 17, 4095, 4096, 4097, 12345)
GROUP = {"lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _tensors(n: int, g: torch.Generator) -> list[torch.Tensor]:
    scales = (0.05, 1e-3, 1e-4, None, 1e-5)
    out = [(torch.randn(n, generator=g) * s).bfloat16() for s in scales if s is not None]
    out.insert(3, (torch.rand(n, generator=g) * 1e-6).bfloat16())
    out[1][::97] = 0.0  # zero gradients
    return out


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("step", [1.0, 7.0])
def test_the_list_steps_bitwise_as_the_compiled_kernel_steps_each(mode: str, decoupled: bool, step: float) -> None:
    scalars = sr_kernel.adam_scalars(GROUP, step, decoupled)
    each = [_tensors(n, torch.Generator().manual_seed(i)) for i, n in enumerate(SIZES)]
    together = copy.deepcopy(each)
    seeds = [12345 * (i + 1) - 2**30 for i in range(len(SIZES))]
    kernel = sr_kernel.compiled_kernel() if mode == "stochastic" else kahan._kernel()
    assert kernel is not None
    with torch.no_grad():
        for (p, g, m, v, c), seed in zip(each, seeds, strict=True):
            extra = torch.tensor(seed, dtype=torch.int32) if mode == "stochastic" else c
            kernel(p, g, m, v, extra, scalars)
    rounding = cpu_lists.STOCHASTIC if mode == "stochastic" else cpu_lists.KAHAN
    rows = [
        (p, g, m, v, c if mode == "kahan" else None, seed)
        for (p, g, m, v, c), seed in zip(together, seeds, strict=True)
    ]
    cpu_lists.adam_step(rows, scalars, rounding)
    for n, a, b in zip(SIZES, each, together, strict=True):
        for name, x, y in zip(("weight", "grad", "exp_avg", "exp_avg_sq", "comp"), a, b, strict=True):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"{name} of {n} values"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 70), nn.Linear(70, 8))


def _train(level: str, make_opt, steps: int = 4, multi: bool = True, monkeypatch=None):  # type: ignore[no-untyped-def]
    model = _model()
    opt = make_opt(model)
    if not multi:
        monkeypatch.setattr(cpu_lists, "available", lambda: False)
    model, opt = mixprec.prepare(model, opt, level=level)
    if not multi:
        monkeypatch.undo()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _two_groups(**options):  # type: ignore[no-untyped-def]
    def make(model: nn.Module) -> torch.optim.Optimizer:
        first, second = list(model[0].parameters()) + list(model[1].parameters()), list(model[3:].parameters())
        return torch.optim.AdamW([{"params": first, "lr": 1e-2, "weight_decay": 0.3},
                                  {"params": second, "lr": 3e-3, "betas": (0.8, 0.95)}], **options)  # fmt: skip

    return make


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
def test_a_prepared_step_is_bitwise_todays_per_tensor_step(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two param groups of their own lr, decay and betas: the one call per group steps each weight, moment and
    compensation as the compiled kernel stepped each weight alone."""
    new, new_opt = _train(level, _two_groups())
    old, old_opt = _train(level, _two_groups(), multi=False, monkeypatch=monkeypatch)
    for (name, a), b in zip(new.named_parameters(), old.parameters(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(new.parameters(), old.parameters(), strict=True):
        for key, value in new_opt.state[p].items():
            assert torch.equal(value, old_opt.state[q][key]), key


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
@pytest.mark.parametrize("form", [{"fused": True}, {"foreach": True}])
def test_a_fused_or_foreach_adamw_steps_the_bf16_weights_with_the_kernel(level: str, form: dict[str, bool]) -> None:
    """The form of the user's AdamW only says how torch would step: the bf16 weights step as with the default."""
    plain, _ = _train(level, _two_groups())
    formed, _ = _train(level, _two_groups(**form))
    state = prepared_state(formed)
    assert state is not None and state.fused
    low = {id(p) for p in state.lowp_params}
    for (name, a), b in zip(formed.named_parameters(), plain.parameters(), strict=True):
        if id(a) in low:
            assert torch.equal(a, b), name


def test_a_checkpoint_loaded_into_the_running_optimizer_is_counted_from() -> None:
    """The host-side step counts follow a state dict loaded mid-run: rewinding replays the same steps bitwise."""
    model, opt = _train("bf16-sr", _two_groups(), steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(2)]

    def run() -> list[torch.Tensor]:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    first = run()
    run()  # the counts move on two more steps
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    again = run()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
def test_a_moment_replaced_mid_run_is_checked_again(level: str) -> None:
    """The list takes a weight it took at the last step without checking its moments again only while they are the
    same tensors: one replaced by an fp32 tensor (a hand-made state) is stepped as a new optimizer given the same
    state steps it (by the per-tensor kernel), bit for bit."""
    model, opt = _train(level, _two_groups(), steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    new, new_opt = _train(level, _two_groups(), steps=0)
    new.load_state_dict(saved_model)
    new_opt.load_state_dict(saved_opt)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    for m, o in ((model, opt), (new, new_opt)):
        weight = m[3].weight
        o.state[weight]["exp_avg"] = o.state[weight]["exp_avg"].float()
        o.zero_grad(set_to_none=True)
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), new.parameters(), strict=True):
        assert torch.equal(a, b), name
        for key, value in opt.state[a].items():
            assert torch.equal(value, new_opt.state[b][key]), f"{name} {key}"


def test_a_grad_scaler_driving_a_fused_adamw_unscales_and_skips() -> None:
    model, opt = _train("bf16-sr", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), steps=1)
    plain, plain_opt = _train("bf16-sr", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    for m, o, s in ((model, opt, scaler), (plain, plain_opt, None)):
        o.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(m(x), y)
        if s is None:
            loss.backward()
            o.step()
        else:
            s.scale(loss).backward()
            s.step(o)
            s.update()
    low = {id(p) for p in prepared_state(model).lowp_params}  # type: ignore[union-attr]
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        if id(a) in low:  # the scale is a power of two: unscaling is exact
            assert torch.equal(a, b)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    scaler.scale(nn.functional.mse_loss(model(x), y) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)


LEVELS = ("O1", "O2", "bf16-pure", "bf16-sr", "bf16-kahan")


@pytest.mark.parametrize("level", LEVELS)
def test_a_steps_ops_do_not_grow_with_the_parameters_and_it_reads_nothing(level: str) -> None:
    """With torch's fused AdamW (itself one call), optimizer.step()'s ops at 2 and at 8 blocks within 1.5x; no
    host read in a whole training step."""
    recipe = step_cost.Recipe(level, level)
    ops, model, opt = step_ops_at(recipe, 32)
    assert ops[1] <= 1.5 * ops[0], ops
    batch = step_cost._batch(2, 8)
    assert step_cost.host_reads(lambda: step_cost._train_step(model, opt, recipe, batch), opt) == 0


@pytest.mark.parametrize("level", LEVELS)
def test_a_step_runs_under_a_dispatch_mode(level: str) -> None:
    """FlopCounterMode (MFU counters, Lightning's measure_flops) around a whole step with a plain AdamW."""
    model, opt = _train(level, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    with FlopCounterMode(display=False) as counter:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 8)).backward()
        opt.step()
    assert counter.get_total_flops() > 0
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_under_a_dispatch_mode_the_eager_update_steps() -> None:
    """The mode sees the update's ops: the compiled kernel and the C++ list stepped nothing there."""
    model, opt = _train("bf16-sr", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=1)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 8)).backward()
    seen = step_cost._Reads(set())
    calls: list[str] = []
    original = stochastic_rounding.cpu_lists.adam_step
    try:
        stochastic_rounding.cpu_lists.adam_step = lambda *a: calls.append("list")  # type: ignore[assignment]
        with seen:
            opt.step()
    finally:
        stochastic_rounding.cpu_lists.adam_step = original  # type: ignore[assignment]
    assert calls == []


def _state_model() -> nn.Module:
    # weights of 4096 values and more take the state precision, the rest the level's state: two a group (of
    # model[:3] and model[3:]), with whole and part chunks of the list kernels' 4096 values and of the moments' blocks
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 72), nn.LayerNorm(72), nn.GELU(), nn.Linear(72, 97),
                         nn.Linear(97, 45), nn.Linear(45, 8))  # fmt: skip


def _listed_as_alone(switch: str, level: str, make_opt: Callable[[nn.Module], torch.optim.Optimizer], seed: int,
                     monkeypatch: pytest.MonkeyPatch, each_run: Callable[[pytest.MonkeyPatch], None] | None = None,
                     **options: Any) -> None:  # fmt: skip
    """Three steps of ``_state_model`` prepared at ``level`` (``options``) with the list kernels, then with
    ``cpu_lists.<switch>`` saying its kernel does not build (the per-tensor step): weights, state keys and every
    state tensor bit for bit. ``each_run``: patches made for both runs."""
    runs = []
    for lists in (True, False):
        if each_run is not None:
            each_run(monkeypatch)
        if not lists:
            monkeypatch.setattr(cpu_lists, switch, lambda *_: False)
        model = _state_model()
        model, opt = mixprec.prepare(model, make_opt(model), level=level, **options)
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 8, generator=g)).backward()
            opt.step()
        monkeypatch.undo()
        runs.append((model, opt))
    _assert_trained_alike(*runs[0], *runs[1])


def _assert_trained_alike(model: nn.Module, opt: Any, other: nn.Module, other_opt: Any) -> None:
    """Weights, state keys and every state tensor of two runs bit for bit."""
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert opt.state[a].keys() == other_opt.state[b].keys(), name
        for key, value in opt.state[a].items():
            assert torch.equal(value, other_opt.state[b][key]), f"{name} {key}"


def _sgd(first: dict[str, Any], second: dict[str, Any]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """torch's SGD over ``_state_model``'s two halves, each group with its own options."""
    return lambda model: torch.optim.SGD([{"params": list(model[:3].parameters()), **first},
                                          {"params": list(model[3:].parameters()), **second}], lr=0.05)  # fmt: skip


@pytest.mark.parametrize("state", ["bf16", "8bit", "4bit", "fp8"])
@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-kahan", "bf16-pure"])
def test_a_state_precisions_list_steps_bitwise_as_each_weight_alone(
    level: str, state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized and bf16 moments: a group's large weights in one call, as cpu_adam's kernel stepped each (two
    groups of their own lr and decay): weights, codes, scales, moments and compensations bit for bit."""

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": list(model[:3].parameters()), "lr": 1e-2, "weight_decay": 0.2},
                                  {"params": list(model[3:].parameters()), "lr": 3e-3}], fused=True)  # fmt: skip

    _listed_as_alone("lists_build", level, adamw, 1, monkeypatch, optimizer_state=state)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "sgd"])
@pytest.mark.parametrize("state", ["bf16", "8bit", "4bit", "fp8"])
def test_o2s_copies_are_written_by_a_state_precisions_list_step(
    state: str, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O2 with quantized or bf16 state (AdamW's for-loop and fused forms, SGD with momentum): the list kernels write
    each large master's bf16 copy with it, and the copies know them as written at their masters' versions (the
    forward after the step copies only the rest); every forward's output and the masters bit for bit as where no
    step writes a copy (each forward after a step copies every master)."""
    makers = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    }

    def run(written: bool) -> tuple[nn.Module, list[torch.Tensor]]:
        model = _state_model()
        model, opt = mixprec.prepare(model, makers[optimizer](model.parameters()), level="O2", optimizer_state=state)
        copies = prepared_state(model).copies  # type: ignore[union-attr]
        # the own step of the fused form and of SGD writes the small weights' copies too
        by_step = {id(p) for p in copies.params if p.numel() >= 4096 or optimizer != "adamw"}
        g = torch.Generator().manual_seed(3)
        outputs = []
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            out = model(torch.randn(8, 64, generator=g))
            outputs.append(out.detach())
            nn.functional.mse_loss(out.float(), torch.zeros(8, 8)).backward()
            opt.step()
            expected = {id(p): p._version for p in copies.params if id(p) in by_step} if written else {}
            assert copies.current == expected  # written, at the versions the step left
        return model, outputs

    with_and_without_step_copies(monkeypatch, run)


@pytest.mark.parametrize(("saved", "running"), [("fp32", "bf16"), ("bf16", "8bit"), ("8bit", "bf16"), ("4bit", "8bit")])
def test_a_state_of_another_precision_loaded_mid_run_is_made_ready_again(saved: str, running: str) -> None:
    """A checkpoint of another state precision loaded into an optimizer that has stepped (its weights found ready
    for the list kernels at its last step): its next steps are those of a new optimizer loaded with it, bit for bit
    (weights and every state tensor)."""

    def trained(state: str, steps: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _state_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model, opt = mixprec.prepare(model, opt, level="O2", optimizer_state=state)
        return _steps(model, opt, steps, seed)

    source, source_opt = trained(saved, 2, 1)
    saved_model, saved_opt = copy.deepcopy(source.state_dict()), copy.deepcopy(source_opt.state_dict())
    runs = []
    for before in (2, 0):  # an optimizer that stepped, then a new one
        model, opt = trained(running, before, 2)
        model.load_state_dict(saved_model)
        opt.load_state_dict(copy.deepcopy(saved_opt))
        runs.append(_steps(model, opt, 2, 3))
    _assert_trained_alike(*runs[0], *runs[1])  # an optimizer that stepped as a new one


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> tuple[nn.Module, Any]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 8, generator=g)).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_a_state_precisions_step_does_not_grow_with_the_parameters(state: str) -> None:
    """optimizer.step()'s ops at 2 and 8 blocks within 1.5x, and no host read in a whole step."""
    for level in ("O2", "bf16-sr"):
        recipe = step_cost.Recipe(level, level, state)
        ops, model, opt = step_ops_at(recipe, 64)
        assert ops[1] <= 1.5 * ops[0], (level, ops)
        whole_step = functools.partial(step_cost._train_step, model, opt, recipe, step_cost._batch(2, 8))
        assert step_cost.host_reads(whole_step, opt) == 0


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("level", ["O2", "bf16-sr"])
def test_bf16_moments_seeds_made_in_the_list_kernel_follow_a_shard(
    level: str, contiguous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list kernel makes each bf16 moment's seed as ``bf16_state.moment_seed`` does, for a shard of a weight too
    (its offset along the whole tensor, or another placement's mixed seed): each weight's large tensors taken as
    shards starting at an offset of their own, the list's moments bit for bit the per-tensor step's."""
    from mixprec._src import sharding

    def shards(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(sharding, "flat_offset", lambda t: (7919 * t.shape[-1] + (1 << 33), contiguous))

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    _listed_as_alone("lists_build", level, adamw, 3, monkeypatch, shards, optimizer_state="bf16")


SGD_GROUPS = (
    ({"momentum": 0.9, "weight_decay": 0.01}, {"momentum": 0.8, "nesterov": True, "lr": 0.02}),
    ({"momentum": 0.9, "dampening": 0.1, "maximize": True}, {"momentum": 0.0, "weight_decay": 0.1}),
)


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
@pytest.mark.parametrize("options", SGD_GROUPS)
def test_sgd_steps_its_bf16_weights_in_one_call_as_on_fp32_copies(
    level: str, options: tuple[dict[str, Any], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's SGD (momentum, dampening, Nesterov, weight decay, maximize; two groups of their own) on the CPU: the
    bf16 weights, their momentum buffers and compensations bit for bit as the optimizer's own step on fp32 copies
    wrote them."""

    _listed_as_alone("sgd_available", level, _sgd(*options), 2, monkeypatch)


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
def test_an_sgd_step_does_not_grow_with_its_bf16_weights(level: str) -> None:
    """keep_types=() (every weight bf16: torch's own for-loop steps none), optimizer.step()'s ops at 2 and 8 blocks
    within 1.5x."""
    batch = step_cost._batch(2, 8)
    ops = []
    for blocks in (2, 8):
        torch.manual_seed(0)
        model: nn.Module = TinyLM(256, 32, blocks, heads=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, opt = mixprec.prepare(model, opt, level=level, keep_types=())
        recipe = step_cost.Recipe(level, level)
        for _ in range(2):
            step_cost._train_step(model, opt, recipe, batch)
        step_cost._forward_backward(model, opt, recipe, batch)
        ops.append(step_cost.count_ops(opt.step))
    assert ops[1] <= 1.5 * ops[0], ops


@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-kahan", "bf16-pure"])
@pytest.mark.parametrize("options", [SGD_GROUPS[0], ({"momentum": 0.9, "dampening": 0.1}, {"momentum": 0.5})])
def test_sgd_with_bf16_momentum_steps_in_one_call_as_each_alone(
    level: str, options: tuple[dict[str, Any], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """optimizer_state="bf16" with torch's SGD: a group's large weights in one call, their weights, buffers (each
    rounded with its own noise) and compensations bit for bit as the per-tensor step on fp32 chunks made them."""

    _listed_as_alone("sgd_bf16_state_builds", level, _sgd(*options), 3, monkeypatch, optimizer_state="bf16")


@pytest.mark.parametrize("state", ["8bit", "4bit", "fp8"])
@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-kahan"])
def test_sgd_with_a_quantized_momentum_steps_in_one_call_as_each_alone(
    level: str, state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """optimizer_state 8bit/4bit/fp8 with torch's SGD (Nesterov and weight decay in one group, dampening in the
    other): a group's large weights in one call, weights, codes, scales and compensations bit for bit as the eager
    step of each made them."""

    _listed_as_alone(
        "sgd_quantized_builds",
        level,
        _sgd({"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, {"momentum": 0.8, "dampening": 0.1}),
        4,
        monkeypatch,
        optimizer_state=state,
    )


# ----- the step counts kept on the host -----------------------------------------------------------


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 5, (torch.float32, torch.float64, torch.float32)])
@pytest.mark.parametrize("start", [0.0, 41.0, 16777214.0, 16777216.0, 3e7])
def test_host_counts_write_what_a_multi_tensor_add_of_one_writes(dtypes: tuple[torch.dtype, ...], start: float) -> None:
    """Every step tensor holds what torch's ``_foreach_add_(steps, 1)`` makes of it (fp32 counts stop at 2**24, fp64
    ones do not), written in one call where all are CPU fp32 scalars, counted on from a value set by hand, and each
    reported written (its version moved) as an add reports it."""
    from mixprec._src.step.host_counts import HostCounts

    states = [{"step": torch.tensor(start, dtype=d)} for d in dtypes]
    params = [torch.zeros(1) for _ in dtypes]
    expected = [s["step"].clone() for s in states]
    counts = HostCounts()
    for turn in range(4):
        if turn == 2:  # a count set by hand: read again
            for s, e in zip(states, expected, strict=True):
                s["step"].fill_(start + 7)
                e.fill_(start + 7)
        versions = [s["step"]._version for s in states]
        got = counts.advance(params, states)
        torch._foreach_add_(expected, 1.0)
        for s, e, value, version in zip(states, expected, got, versions, strict=True):
            assert s["step"].dtype is e.dtype and torch.equal(s["step"], e) and value == e.item()
            assert s["step"]._version > version


def test_host_counts_under_a_dispatch_mode_add_as_torch_does() -> None:
    """Under a dispatch mode the counts are one multi-tensor add the mode sees (not a write it cannot)."""
    from mixprec._src.step.host_counts import HostCounts

    states = [{"step": torch.tensor(3.0)} for _ in range(3)]
    with OpNames() as seen:
        assert HostCounts().advance([torch.zeros(1) for _ in states], states) == [4.0] * 3
    assert "_foreach_add_" in seen.names and all(s["step"].item() == 4.0 for s in states)


def test_the_step_scalars_made_on_the_host_are_the_ops_scalars() -> None:
    """The state precisions' list makes its step scalars on the host (the bias corrections by the C library's powf,
    as ATen's loop makes one value): bit for bit what the seven tensor ops make, over betas, counts (past 2**24),
    learning rates and decays."""
    from mixprec._src.optim import fused_adam

    rng = random.Random(7)
    for _ in range(1500):
        group = {
            "lr": rng.choice([1e-3, 3e-4, rng.random()]),
            "betas": (rng.choice([0.9, 0.95, rng.random()]), rng.choice([0.999, 0.99, rng.random()])),
            "eps": rng.choice([1e-8, 1e-6]),
            "weight_decay": rng.choice([0.0, 0.01, rng.random()]),
        }
        count = float(torch.tensor(float(rng.choice([1, 2, 3, 1000, rng.randint(1, 1 << 25)]))))  # as fp32 holds it
        for decoupled in (True, False):
            want = fused_adam.step_scalars(group, torch.tensor(count), decoupled, torch.device("cpu"))
            got = fused_adam.host_step_scalars(group, count, decoupled)
            if got is None:
                pytest.skip("no C library powf here")
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (group, count, decoupled)
