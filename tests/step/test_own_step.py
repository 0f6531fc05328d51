"""torch's own Adam(W) and SGD steps of fp32 weights in one call a param group on the CPU (step/own_step.py): bit
for bit torch's for-loop and foreach steps, their ops constant in the model, and torch's own step wherever they cannot
be."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import OpNames, step_ops_at, with_and_without_step_copies
from mixprec._src.optim import aten_lists, cpu_lists, fused_lists
from mixprec._src.prepare.levels import prepared_state
from mixprec._src.step import own_step
from mixprec.bench import step_cost


def test_the_kernels_step_as_torch_here() -> None:
    """They build and their probes match torch's steps on this machine (MKL's square root found in torch's library):
    else every test below would pass on torch's own step."""
    assert aten_lists.available() and aten_lists.sgd_available() and fused_lists.available()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # sizes that leave vector tails and span chunks of 4096 values
    return nn.Sequential(nn.Linear(67, 129), nn.LayerNorm(129), nn.Linear(129, 3), nn.Linear(3, 5000))


def _groups(model: nn.Module, options: dict[str, Any]) -> list[dict[str, Any]]:
    first, second = list(model.parameters())[:3], list(model.parameters())[3:]
    return [{"params": first, **options}, {"params": second, "lr": 0.3, "betas": (0.3, 0.5)}]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 67, generator=g)).square().mean().backward()
        if step == 1:  # a weight without a gradient this step: its count falls behind the others'
            model[2].weight.grad = None
        opt.step()


OPTIONS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam-l2": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}),
    "adam-decoupled": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}),
    "adamw-maximize": (torch.optim.AdamW, {"lr": 1e-3, "maximize": True, "eps": 1e-3}),
}


FORMS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_own_step_step_as_torchs_step_bit_for_bit(name: str, form: str) -> None:
    """Two param groups of their own options, a weight whose count falls behind: weights, moments and counts as
    torch's own step (its for-loop, foreach and fused forms) leaves them."""
    kind, options = OPTIONS[name]
    models = [_model(), _model()]
    torchs = kind(_groups(models[0], options), **FORMS[form])
    ours = kind(_groups(models[1], options), **FORMS[form])
    handles: list[Any] = []
    own_step.install(ours, handles)
    _train(models[0], torchs)
    _train(models[1], ours)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in torchs.state[a].items():
            assert torch.equal(value, ours.state[b][key]), key
    assert float(ours.state[models[1][2].weight]["step"]) == 3.0  # one step without a gradient
    for h in handles:
        h.remove()
    assert "_init_group" not in ours.__dict__


def test_what_it_does_not_take_is_torchs_step() -> None:
    """An amsgrad group and an fp64 weight stay with torch's step: it takes the rest of their lists."""
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(40)) for _ in range(3)] + [nn.Parameter(torch.randn(40, dtype=torch.float64))]
    copies = [nn.Parameter(w.detach().clone()) for w in weights]

    def groups(ws: list[nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": [ws[0]], "amsgrad": True}, {"params": [ws[1], ws[3]]}, {"params": [ws[2]]}]

    torchs, ours = torch.optim.AdamW(groups(weights), lr=0.1), torch.optim.AdamW(groups(copies), lr=0.1)
    own_step.install(ours, [])
    assert aten_lists.available(torch.bfloat16)  # its probe run before the count starts
    taken: list[int] = []
    real = aten_lists.table

    def counting(rows: Any) -> Any:  # the tables the step makes (at a group's first step, and where its lists change)
        taken.extend(id(r[0]) for r in rows)
        return real(rows)

    aten_lists.table = counting  # type: ignore[assignment]
    try:
        for _ in range(3):
            for a, b in zip(weights, copies, strict=True):
                a.grad = torch.full_like(a, 0.5)
                b.grad = torch.full_like(b, 0.5)
            torchs.step()
            ours.step()
    finally:
        aten_lists.table = real  # type: ignore[assignment]
    assert set(taken) == {id(copies[1]), id(copies[2])}
    assert all(torch.equal(a, b) for a, b in zip(weights, copies, strict=True))


SGD_OPTIONS = {
    "momentum-dampening-decay": {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01},
    "nesterov-maximize": {"lr": 0.05, "momentum": 0.8, "nesterov": True, "maximize": True},
    "plain-decay": {"lr": 0.1, "weight_decay": 0.1},
}


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", list(SGD_OPTIONS))
def test_sgds_own_step_step_as_torchs_step_bit_for_bit(name: str, foreach: bool) -> None:
    """SGD's weights and momentum buffers (made at a weight's first step, one made a step later for the weight that
    had no gradient) as torch's own step leaves them."""
    models = [_model(), _model()]
    torchs = torch.optim.SGD(_groups(models[0], SGD_OPTIONS[name]), lr=0.01, foreach=foreach)
    ours = torch.optim.SGD(_groups(models[1], SGD_OPTIONS[name]), lr=0.01, foreach=foreach)
    own_step.install(ours, [])
    _train(models[0], torchs)
    _train(models[1], ours)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        assert set(torchs.state[a]) == set(ours.state[b])
        for key, value in torchs.state[a].items():
            assert torch.equal(value, ours.state[b][key]), key


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", list(SGD_OPTIONS))
def test_sgds_own_step_of_bf16_weights_is_torchs_bit_for_bit(
    name: str, foreach: bool, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights (bf16-pure's) with SGD: ATen's bf16 add with alpha rounds once in its vector loop and twice in
    the tail of each thread's share of a tensor (the 73,700 values of the first weight are split between two
    threads); weights and buffers as torch's for-loop and foreach steps leave them (a buffer started a step late:
    the foreach form's momentum is then fp32), every weight taken."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert aten_lists.sgd_bf16_available()  # its probe run before the count starts
        taken: list[int] = []
        real = aten_lists.sgd_bf16_step
        monkeypatch.setattr(aten_lists, "sgd_bf16_step", lambda rows, *a: (taken.append(len(rows)), real(rows, *a)))

        def model() -> nn.Module:
            torch.manual_seed(0)
            layers = (nn.Linear(67, 1100), nn.LayerNorm(1100), nn.Linear(1100, 3), nn.Linear(3, 5000))
            return nn.Sequential(*layers).bfloat16()

        models = [model(), model()]
        torchs = torch.optim.SGD(_groups(models[0], SGD_OPTIONS[name]), lr=0.01, foreach=foreach)
        ours = torch.optim.SGD(_groups(models[1], SGD_OPTIONS[name]), lr=0.01, foreach=foreach)
        own_step.install(ours, [])
        for net, opt in zip(models, (torchs, ours), strict=True):
            g = torch.Generator().manual_seed(1)
            for step in range(4):
                opt.zero_grad(set_to_none=True)
                net(torch.randn(8, 67, generator=g).bfloat16()).float().square().mean().backward()
                if step == 0:  # its buffer (in the group with momentum) starts a step after the others'
                    net[0].bias.grad = None
                opt.step()
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        assert set(torchs.state[a]) == set(ours.state[b])
        for key, value in torchs.state[a].items():
            assert torch.equal(value, ours.state[b][key]), key
    assert sum(taken) == 4 * 8 - 1  # every weight at every step but the one without a gradient


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ["adamw", "adam-l2", "adamw-maximize"])
def test_bf16_weights_step_as_torchs_step_bit_for_bit(name: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights and moments (bf16-pure's): in the for-loop and foreach forms each op rounded to bf16 as ATen
    rounds it (Adam's L2 decay of a bf16 weight left to torch's step: the same bits either way); in the fused form
    in fp32 from the bf16 values as torch's fused kernel computes them, L2 decay included."""
    kind, options = OPTIONS[name]
    models = [_model().bfloat16(), _model().bfloat16()]
    torchs = kind(_groups(models[0], options), **FORMS[form])
    ours = kind(_groups(models[1], options), **FORMS[form])
    own_step.install(ours, [])
    assert aten_lists.available(torch.bfloat16) and fused_lists.available(torch.bfloat16)  # probes before the count
    taken: list[int] = []
    for module in (aten_lists, fused_lists):
        real = module.table

        def counting(rows: Any, real: Any = real) -> Any:
            taken.extend(id(r[0]) for r in rows if r[0].dtype is torch.bfloat16)
            return real(rows)

        monkeypatch.setattr(module, "table", counting)
    for model, opt in zip(models, (torchs, ours), strict=True):
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(8, 67, generator=g).bfloat16()).float().square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in torchs.state[a].items():
            assert torch.equal(value, ours.state[b][key]), key
    decayed = {id(p) for p in ours.param_groups[0]["params"]}  # the first group's: the options' decay
    assert set(taken) == {id(p) for g in ours.param_groups for p in g["params"]} - (
        decayed if name == "adam-l2" and form != "fused" else set()
    )


@pytest.mark.parametrize("form", list(FORMS))
def test_a_groups_kept_tables_step_as_torch_through_what_changes(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A param group whose lists hold the tensors of its last step steps from the tables kept then (the new gradients'
    addresses written in): bit for bit torch's step through a learning rate changed, a state loaded (new tensors),
    a weight without a gradient, one whose gradient is not contiguous and one stored anew; and the tables are not made
    anew at the steps where nothing changed."""
    assert aten_lists.available() and fused_lists.available()  # their probes run before the count starts
    made: list[int] = []
    for module in (aten_lists, fused_lists):
        real = module.table
        monkeypatch.setattr(module, "table", lambda rows, real=real: (made.append(len(rows)), real(rows))[1])
    models = [_model(), _model()]
    opts = [torch.optim.AdamW(_groups(m, {"weight_decay": 0.1}), lr=1e-2, **FORMS[form]) for m in models]
    own_step.install(opts[1], [])
    g = torch.Generator().manual_seed(1)
    for step in range(9):
        x = torch.randn(8, 67, generator=g)
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if step == 3:
                opt.param_groups[1]["lr"] *= 0.5
            if step == 5:
                opt.load_state_dict(opt.state_dict())
            if step == 6:
                model[0].weight.grad = model[0].weight.grad.t().contiguous().t()
                model[2].weight.data = model[2].weight.data.clone()  # the same tensor, stored elsewhere
            if step == 7:
                model[3].bias.grad = None
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in opts[0].state[a].items():
            assert torch.equal(value, opts[1].state[b][key]), key
    assert len(made) <= 2 * 9 - 2 * 4, made  # none at steps 1 to 4 (a learning rate changed at 3)


@pytest.mark.parametrize("form", ["for-loop", "fused"])
def test_o2s_copies_are_those_of_its_masters_whichever_step_wrote_them(form: str) -> None:
    """O2 with AdamW (the fused form writes the masters' bf16 copies in its pass; an amsgrad group is torch's own,
    whose copies the forward refreshes; a master written in place after a step is copied again; two steps before a
    forward, the second leaving a weight to torch's step): each forward's output and the masters as with the stage
    switched off."""
    runs = []
    for on in (True, False):
        model = _model()
        first, second = list(model.parameters())[:3], list(model.parameters())[3:]
        groups = [{"params": first, "amsgrad": True}, {"params": second}]
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, **FORMS[form])
        model, opt = mixprec.prepare(model, opt, level="O2")
        if not on:
            opt.__dict__.pop("_init_group")
        g = torch.Generator().manual_seed(1)
        outputs = []
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            out = model(torch.randn(8, 67, generator=g))
            out.float().square().mean().backward()
            opt.step()
            outputs.append(out.detach())
            if step == 1:  # a second step before the next forward, the weight whose copy the first wrote left to torch
                for p in model.parameters():  # (its gradient not contiguous)
                    p.grad = torch.full_like(p, 1e-3) if p is not model[3].weight else torch.ones(3, 5000).t()
                opt.step()
            if step == 2:
                with torch.no_grad():
                    model[3].weight.mul_(0.5)
        runs.append((model, outputs))
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_o2s_copies_are_written_by_sgds_own_step(momentum: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """O2 with SGD (with and without momentum, decay and nesterov in one group): its one call writes each master's
    bf16 copy with it, told to the copies at the version the step leaves (the forward after the step copies none);
    the masters and every forward's output bit for bit as where no step writes a copy, with a master written in place
    between two steps and a weight without a gradient at one."""

    def run(written: bool) -> tuple[nn.Module, list[torch.Tensor]]:
        model = _model()
        options = {"nesterov": True, "weight_decay": 0.01} if momentum else {}
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, **options)
        model, opt = mixprec.prepare(model, opt, level="O2")
        copies = prepared_state(model).copies  # type: ignore[union-attr]
        g = torch.Generator().manual_seed(2)
        outputs = []
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            out = model(torch.randn(8, 67, generator=g))
            outputs.append(out.detach())
            out.float().square().mean().backward()
            if step == 1:
                model[2].weight.grad = None
            opt.step()
            stepped = [p for p in copies.params if p.grad is not None]
            assert copies.current == ({id(p): p._version for p in stepped} if written else {})
            if step == 2:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
        return model, outputs

    with_and_without_step_copies(monkeypatch, run)


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach", "adamw-fused", "sgd"])
def test_a_levels_step_is_one_call_whatever_the_model(level: str, optimizer: str) -> None:
    """With torch's for-loop (its CPU default), foreach and fused AdamW and with SGD, O1's, O2's, bf16-sr's (its kept
    norms) and bf16-pure's ``optimizer.step()`` dispatch as many ops at 8 blocks as at 2; torch.amp's grow (but with
    the fused form: one kernel a group already)."""
    ops, _, _ = step_ops_at(step_cost.Recipe(level, level), 32, optimizer=optimizer)
    assert ops[0] == ops[1] < 16, ops
    amp_ops, _, _ = step_ops_at(step_cost.Recipe("torch-amp"), 32, optimizer=optimizer)
    assert amp_ops[1] > 2 * amp_ops[0] if optimizer != "adamw-fused" else amp_ops[1] == amp_ops[0]


def test_prepare_steps_o2s_masters_as_torch_would() -> None:
    """O2 with torch's default AdamW: the masters and moments as an O2 whose stage is switched off leaves them."""
    runs = []
    for on in (True, False):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = mixprec.prepare(model, opt, level="O2")
        if not on:
            opt.__dict__.pop("_init_group")
        _train(model, opt)
        runs.append((model, opt))
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(runs[0][1].state[a]["exp_avg_sq"], runs[1][1].state[b]["exp_avg_sq"])


def test_a_kernel_that_does_not_match_torch_here_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe: where the kernel's step differs from torch's on this machine (here a step size off by a place), it is
    not used and torch's own step runs: still bit for bit."""
    real = aten_lists.scalars

    def off(group: dict[str, Any], step: float, decoupled: bool, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        scalars, flags = real(group, step, decoupled, dtype)
        scalars[6] = torch.nextafter(scalars[6], torch.tensor(0.0))
        return scalars, flags

    monkeypatch.setattr(aten_lists, "scalars", off)
    monkeypatch.setattr(cpu_lists, "_failed", set())
    monkeypatch.setattr(aten_lists, "_done", set())
    assert not aten_lists.available() and not aten_lists.expected()
    models = [_model(), _model()]
    torchs = torch.optim.AdamW(models[0].parameters(), lr=1e-2, eps=1e-3)
    ours = torch.optim.AdamW(models[1].parameters(), lr=1e-2, eps=1e-3)
    own_step.install(ours, [])
    _train(models[0], torchs)
    _train(models[1], ours)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))


def test_a_dispatch_mode_around_the_first_step_sees_the_step_and_not_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes run at the first step that needs them, with the thread's dispatch modes set aside: a mode around
    that step (FlopCounterMode, a memory tracker) sees the ops it sees where the probe ran before."""

    def first_step() -> list[str]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        own_step.install(opt, [])
        model(torch.randn(8, 67)).square().mean().backward()
        with OpNames() as mode:
            opt.step()
        return mode.names

    assert aten_lists.available()
    probed_before = first_step()
    monkeypatch.setattr(cpu_lists, "_failed", set())
    monkeypatch.setattr(aten_lists, "_done", set())
    probed_now = first_step()
    assert probed_now == probed_before and len(probed_now) < 40, probed_now


def test_o2s_copies_are_not_written_where_no_eager_forward_reads_them() -> None:
    """The fused step writes O2's copies where an eager forward read them since the last step (a compiled forward
    casts the masters in its graph and reads none): a second step with no forward between leaves them as they
    were, and the next forward copies the masters then."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = mixprec.prepare(model, opt, level="O2")
    state = prepared_state(model)
    assert state is not None and state.copies is not None
    x = torch.randn(8, 67)
    model(x).float().square().mean().backward()
    opt.step()
    copies = {k: c.clone() for k, c in state.copies.copies.items()}
    assert all(torch.equal(copies[id(p)], p.detach().bfloat16()) for p in state.copies.params)
    opt.step()  # the same gradients again, no forward between
    assert all(torch.equal(c, state.copies.copies[k]) for k, c in copies.items())
    model(x)
    assert all(torch.equal(state.copies.copies[id(p)], p.detach().bfloat16()) for p in state.copies.params)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach", "adamw-fused", "sgd"])
@pytest.mark.parametrize(
    ("level", "state"),
    [(level, "fp32") for level in ("O1", "O2", "bf16-pure", "bf16-sr", "bf16-kahan")]
    + [("O2", "8bit"), ("O2", "bf16"), ("bf16-sr", "8bit"), ("bf16-sr", "bf16")],
)
def test_a_weight_stepped_between_forward_and_backward_is_reported_as_torch_reports_it(
    level: str, state: str, optimizer: str
) -> None:
    # torch's for-loop and foreach steps write the weights with in-place ops (their versions move: autograd reports
    # a backward through a weight written since its forward); its fused kernel does not move them
    kind, options = step_cost.OPTIMIZERS[optimizer]

    def stepped_between(prepared: bool) -> bool:
        torch.manual_seed(0)
        # the norm's fp32 weight is saved; the first weight is large enough for a state precision
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 2))
        if not prepared:
            model = model.to(torch.bfloat16)
        opt = kind(model.parameters(), **options)
        if prepared:
            model, opt = mixprec.prepare(model, opt, level=level, optimizer_state=state)
        x = torch.randn(4, 64, dtype=torch.float32 if prepared else torch.bfloat16)
        model(x).float().sum().backward()
        opt.step()
        loss = model(x).float().sum()
        before = [p._version for p in model.parameters()]
        opt.step()  # between the forward and its backward
        moved = [p._version != v for p, v in zip(model.parameters(), before, strict=True)]
        assert moved == [optimizer != "adamw-fused"] * len(moved)  # every weight's, whichever stage stepped it
        try:
            loss.backward()
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            return True
        return False

    assert stepped_between(True) == stepped_between(False) == (optimizer != "adamw-fused")
