"""Adam(W)'s moments and SGD's momentum in bf16 with stochastic rounding (``optimizer_state="bf16"``): each step is
the fp32 step with its moments rounded to one of their two bf16 neighbours, unbiased where round-to-nearest stalls,
bitwise resume at every level, checkpoints across state precisions, half the bytes, stepping in backward alike."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import resumed, state_data, state_mlp
from mixprec._src.optim import moments


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> list[float]:
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of fp32 ``x``: cut towards zero, and one step further from zero."""
    cut = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)
    away = ((x.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return cut, away


def _adamw_by_hand(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                   lr: float, wd: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """AdamW in fp32 (torchao's ``single_param_adam``'s operations: lerp for both moments)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    lr_t = torch.tensor(lr)
    p = p - lr_t * wd * p
    m = m.lerp(g, 1 - beta1)
    v = v.lerp(g.square(), 1 - beta2)
    bc1, bc2 = 1 - beta1 ** torch.tensor(float(step)), 1 - beta2 ** torch.tensor(float(step))
    return m, v, p - lr_t * (m / bc1) / (v.sqrt() / bc2.sqrt() + eps)


@pytest.fixture
def chunked_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 state's step on fp32 copies, a chunk at a time (torch's operations), not cpu_adam's kernel (the
    default on the CPU: bitwise it but where torch's sqrt is not correctly rounded, below)."""
    from mixprec._src.optim import cpu_adam

    monkeypatch.setattr(cpu_adam, "bf16_builds", lambda *_: False)


@pytest.mark.usefixtures("chunked_step")
def test_a_step_is_adamws_in_fp32_with_each_moment_stored_as_one_of_its_bf16_neighbours() -> None:
    layer = nn.Linear(64, 128, bias=False)  # 8192 values: its state is bf16
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    mixprec.prepare(layer, optimizer, "O1", optimizer_state="bf16")
    g = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        state = optimizer.state[layer.weight]
        p = layer.weight.detach().clone()
        m0, v0 = (state[k].float() if k in state else torch.zeros_like(p) for k in ("exp_avg", "exp_avg_sq"))
        layer.weight.grad = torch.randn(layer.weight.shape, generator=g)
        optimizer.step()
        m, v, new = _adamw_by_hand(p, layer.weight.grad, m0, v0, step, 1e-2, 0.1)
        assert torch.equal(layer.weight.detach(), new)  # the weight moves by the fp32 moments of this step
        for name, exact in (("exp_avg", m), ("exp_avg_sq", v)):
            stored = optimizer.state[layer.weight][name]
            assert stored.dtype is torch.bfloat16 and stored.shape == layer.weight.shape
            cut, away = _neighbours(exact)
            assert ((stored.float() == cut) | (stored.float() == away)).all(), name
            # stochastic: as often up as the discarded fraction says, not always to the nearest (3/4 of the time)
            nearest = (stored == exact.to(torch.bfloat16)).float().mean().item()
            assert 0.65 < nearest < 0.85, (name, nearest)


def test_stochastic_rounding_lets_a_slow_second_moment_grow_where_round_to_nearest_stalls() -> None:
    """A constant gradient of 1 and beta2 = 0.999: v_t = 1 - 0.999^t in fp32. Rounded to nearest in bf16, an
    increment below half a step is lost every time, and v stops far below; rounded stochastically, its mean
    follows fp32's."""
    steps, beta2 = 600, 0.999
    layer = nn.Linear(64, 64, bias=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.0, betas=(0.9, beta2))
    mixprec.prepare(layer, optimizer, "O1", optimizer_state="bf16")
    nearest = torch.zeros(64, 64, dtype=torch.bfloat16)
    for _ in range(steps):
        layer.weight.grad = torch.ones(64, 64)
        optimizer.step()
        nearest = nearest.float().lerp(torch.ones(64, 64), 1 - beta2).to(torch.bfloat16)
    exact = 1 - beta2**steps
    ours = optimizer.state[layer.weight]["exp_avg_sq"].float().mean().item()
    assert abs(ours / exact - 1) < 0.01, (ours, exact)
    assert nearest.float().mean().item() < 0.9 * exact  # what plain bf16 state would hold


@pytest.mark.parametrize(
    ("level", "kind"),
    [("O1", "adamw"), ("O2", "adam"), ("bf16-sr", "adamw"), ("bf16-kahan", "adamw"), ("O2", "sgd"), ("bf16-sr", "sgd")],
)
def test_a_run_resumed_from_state_dicts_continues_bit_for_bit(level: str, kind: str) -> None:
    data = state_data(8)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = state_mlp()
        if kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            optimizer = getattr(torch.optim, "AdamW" if kind == "adamw" else "Adam")(model.parameters(), lr=3e-3,
                                                                                   weight_decay=0.01)  # fmt: skip
        return mixprec.prepare(model, optimizer, level, optimizer_state="bf16")

    whole = _train(*fresh(), data)
    model, optimizer = fresh()
    first = _train(model, optimizer, data[:4])
    model, optimizer, saved = resumed(model, optimizer, fresh)  # load_state_dict casts to the parameter's dtype
    assert saved["optimizer"]["state"][2]["exp_avg" if kind != "sgd" else "momentum_buffer"].dtype is torch.bfloat16
    weight = optimizer.param_groups[0]["params"][2]
    assert all(v.dtype is torch.bfloat16 for k, v in optimizer.state[weight].items() if k != "step")
    assert first + _train(model, optimizer, data[4:]) == whole


def test_checkpoints_move_between_fp32_bf16_and_quantized_state() -> None:
    data = state_data(8)
    plain = state_mlp()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    _train(plain, plain_opt, data[:2])
    model = copy.deepcopy(plain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mixprec.prepare(model, optimizer, "O1", optimizer_state="bf16")
    optimizer.load_state_dict(plain_opt.state_dict())  # fp32 moments: rounded to nearest
    weight = model[2].weight
    fp32_moment = plain_opt.state[plain[2].weight]["exp_avg"]
    assert torch.equal(optimizer.state[weight]["exp_avg"], fp32_moment.to(torch.bfloat16))
    assert optimizer.state[model[2].bias]["exp_avg"].dtype is torch.float32  # small: as the level keeps it
    _train(model, optimizer, data[2:4])

    eight = copy.deepcopy(model)  # the bf16 state into an 8-bit run: quantized at its next step
    mixprec.export_fp32(eight)
    eight_opt = torch.optim.AdamW(eight.parameters(), lr=3e-3)
    mixprec.prepare(eight, eight_opt, "O1", optimizer_state="8bit")
    eight_opt.load_state_dict(optimizer.state_dict())
    _train(eight, eight_opt, data[4:6])
    assert moments.is_quantized(eight_opt.state[eight[2].weight])

    back = copy.deepcopy(eight)  # and the 8-bit state into a bf16 run: dequantized, then rounded
    mixprec.export_fp32(back)
    back_opt = torch.optim.AdamW(back.parameters(), lr=3e-3)
    mixprec.prepare(back, back_opt, "O1", optimizer_state="bf16")
    back_opt.load_state_dict(eight_opt.state_dict())
    codes = eight_opt.state[eight[2].weight]
    dequantized = moments.load(codes, "exp_avg_sq", eight[2].weight.shape)
    _train(back, back_opt, data[6:7])
    state = back_opt.state[back[2].weight]
    assert not moments.is_quantized(state) and state["exp_avg_sq"].dtype is torch.bfloat16
    grad_sq = back[2].weight.grad  # freed by zero_grad at the next step only
    assert grad_sq is not None
    expected = dequantized.to(torch.bfloat16).float().lerp(grad_sq.float().square(), 1 - 0.999)
    cut, away = _neighbours(expected)
    assert ((state["exp_avg_sq"].float() == cut) | (state["exp_avg_sq"].float() == away)).all()

    mixprec.export_fp32(back, back_opt)  # fp32 moments a plain AdamW continues from
    assert back_opt.state[back[2].weight]["exp_avg"].dtype is torch.float32
    _train(back, back_opt, data[7:])


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
def test_bf16_moments_hold_half_the_bytes_and_the_plan_says_so(level: str) -> None:
    reports, plans = {}, {}
    for precision in ("fp32", "bf16"):
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
        optimizer = torch.optim.AdamW(model.parameters())
        config = mixprec.PrepareConfig(level, optimizer_state=precision)
        plans[precision] = mixprec.memory_plan(model, optimizer, config)
        mixprec.prepare(model, optimizer, config)
        _train(model, optimizer, [(torch.randn(4, 512), torch.randn(4, 512))])
        reports[precision] = mixprec.memory_report(model, optimizer)
        assert plans[precision].optimizer_state == reports[precision].optimizer_state
    params = sum(p.numel() for p in model.parameters())
    per_param = {k: r.optimizer_state / params for k, r in reports.items()}
    if level == "bf16-sr":  # the level keeps bf16 moments already: the same bytes, rounded stochastically
        assert per_param["bf16"] == per_param["fp32"]
    else:
        assert 8.0 <= per_param["fp32"] < 8.01 and 4.0 < per_param["bf16"] < 4.02  # fp32 biases, step counts


def test_stepping_in_backward_with_bf16_state_is_stepping_after_it_bitwise() -> None:
    data = state_data(4)
    runs: dict[bool, Any] = {}
    for in_backward in (False, True):
        model = state_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        mixprec.prepare(model, optimizer, "bf16-sr", optimizer_state="bf16", step_in_backward=in_backward)
        losses = _train(model, optimizer, data)
        runs[in_backward] = (losses, [p.detach().clone() for p in model.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))


def test_what_cannot_keep_bf16_moments_is_refused_with_what_to_do() -> None:
    model = nn.Linear(64, 64)
    with pytest.raises(ValueError, match="AdamW with amsgrad: use one of them"):
        mixprec.prepare(model, torch.optim.AdamW(model.parameters(), amsgrad=True), "O2", optimizer_state="bf16")
    with pytest.raises(ValueError, match=r"SGD's momentum buffer .* this one has no momentum"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", optimizer_state="bf16")
    assert str(mixprec.PrepareConfig("O2", optimizer_state="bf16")).endswith("state=bf16")


@pytest.mark.usefixtures("chunked_step")
@pytest.mark.parametrize("level", ["O1", "bf16-sr"])
def test_the_chunks_a_step_is_taken_in_do_not_change_a_bit(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step reads a chunk of values at a time; each element keeps the noise of its place in the whole tensor,
    so the chunk size changes nothing (the 256x256 weight: one chunk, or 64 of 1024 values)."""
    from mixprec._src.step import bf16_state

    data, runs = state_data(3), []
    for chunk in (bf16_state.CHUNK, 1024):
        monkeypatch.setattr(bf16_state, "CHUNK", chunk)
        model = state_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        mixprec.prepare(model, optimizer, level, optimizer_state="bf16")
        _train(model, optimizer, data)
        state = optimizer.state[model[2].weight]
        runs.append([model[2].weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("options", [{"nesterov": True, "weight_decay": 0.1}, {"dampening": 0.5}])
def test_an_sgd_step_is_torchs_from_the_stored_buffer_with_the_new_one_rounded_to_a_neighbour(options: dict) -> None:
    """torch's SGD given the bf16 buffer as its fp32 buffer moves the weight as mixprec's step does, bit for bit;
    mixprec stores one of the two bf16 neighbours of torch's new buffer (the first step's is the gradient)."""
    layer = nn.Linear(64, 128, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, **options)
    mixprec.prepare(layer, optimizer, "O1", optimizer_state="bf16")
    twin = nn.Parameter(layer.weight.detach().clone())
    torchs = torch.optim.SGD([twin], lr=0.1, momentum=0.9, foreach=False, **options)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        stored = optimizer.state[layer.weight].get("momentum_buffer")
        if stored is not None:
            torchs.state[twin]["momentum_buffer"] = stored.float().clone()
        twin.data.copy_(layer.weight.detach())
        layer.weight.grad = torch.randn(layer.weight.shape, generator=g)
        twin.grad = layer.weight.grad.clone()
        optimizer.step()
        torchs.step()
        assert torch.equal(layer.weight.detach(), twin.detach())
        cut, away = _neighbours(torchs.state[twin]["momentum_buffer"])
        buffer = optimizer.state[layer.weight]["momentum_buffer"].float()
        assert ((buffer == cut) | (buffer == away)).all()


@pytest.mark.parametrize(("level", "kind"), [("O2", "adamw"), ("bf16-sr", "adamw"), ("bf16-kahan", "adam"),
                                             ("bf16-pure", "adamw")])  # fmt: skip
def test_the_cpu_kernel_is_the_chunked_step(level: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_adam's kernel against the step on fp32 copies: the moments bit for bit; where torch's CPU sqrt is
    correctly rounded, bf16 weights bit for bit and fp32 weights within a unit in the last place (the chunked
    step's arithmetic order); where it is not, a bf16 weight may round to its other neighbour and an fp32 weight
    near zero differs by many of its ulps."""
    from mixprec._src.optim import cpu_adam

    data, runs = state_data(1 if level == "O2" else 4), []  # fp32 weights: one step (an ulp compounds)
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(cpu_adam, "bf16_builds", lambda *_: False)
        model = _ragged_mlp()
        make = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        optimizer = make(model.parameters(), lr=3e-3, weight_decay=0.01)
        mixprec.prepare(model, optimizer, level, optimizer_state="bf16")
        for x, y in data:
            optimizer.zero_grad()
            (model(x).float() - y).square().mean().backward()
            optimizer.step()
        weight = optimizer.param_groups[0]["params"][2]  # O2: the master
        state = optimizer.state[weight]
        assert cpu_adam.bf16_available(weight.detach(), weight.grad, state["exp_avg"]) == kernel
        runs.append((weight.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
    (w_kernel, *m_kernel), (w_chunks, *m_chunks) = runs
    assert all(torch.equal(a, b) for a, b in zip(m_kernel, m_chunks, strict=True))
    exact = _torch_sqrt_is_correctly_rounded()
    if w_kernel.dtype is torch.bfloat16 and exact:
        assert torch.equal(w_kernel, w_chunks)
    elif w_kernel.dtype is torch.bfloat16:  # an update an ulp apart rounds to the other bf16 neighbour, rarely
        apart = w_kernel != w_chunks
        assert apart.float().mean() < 0.01
        step = (w_chunks.float().abs() * 2**-7).clamp_min(2**-126)
        assert ((w_kernel.float() - w_chunks.float()).abs()[apart] <= step[apart]).all()
    else:  # near zero, an ulp of the update is many of the weight's
        torch.testing.assert_close(w_kernel, w_chunks, rtol=2**-22 if exact else 2**-13, atol=0 if exact else 1e-9)
        assert not torch.equal(w_kernel.to(torch.bfloat16).float(), w_kernel)  # fp32 indeed


def _ragged_mlp() -> nn.Module:
    """Two weights of 4096 values or more; the second's last values (4575 = 4096 + 14 * 32 + 31) go through the
    kernel's every loop: two vectors at a time, one, and one value at a time (with AVX-512's 16 lanes and AVX2's 8)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 75), nn.GELU(), nn.Linear(75, 61), nn.GELU(), nn.Linear(61, 1))


def _torch_sqrt_is_correctly_rounded() -> bool:
    """Whether torch's eager fp32 sqrt is correctly rounded on this CPU (the kernel's always is): on some CPUs'
    vector paths it is not (seen on an AMD EPYC with AVX-512: a fifth of random values an ulp off)."""
    x = torch.rand(1 << 14, generator=torch.Generator().manual_seed(0)) * 1e-6
    return torch.equal(x.sqrt(), x.double().sqrt().float())


def test_the_per_weight_bf16_momentum_starts_from_the_gradient_whatever_the_dampening() -> None:
    # torch's SGD starts its buffer as the gradient itself; dampening applies from the second step on. A
    # weight that is not contiguous takes the per-weight step (bf16_state.sgd_step), not the group's list.
    torch.manual_seed(0)
    layer = nn.Linear(128, 64, bias=False)
    layer.weight = nn.Parameter(torch.randn(128, 64).t())
    assert not layer.weight.is_contiguous() and layer.weight.numel() >= moments.MIN_NUMEL
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    layer, opt = mixprec.prepare(layer, opt, level="bf16-sr", optimizer_state="bf16")
    layer(torch.randn(8, 128)).square().sum().backward()
    grad = layer.weight.grad.float().clone()
    opt.step()
    buffer = opt.state[layer.weight]["momentum_buffer"].float()
    torch.testing.assert_close(buffer, grad, rtol=1e-2, atol=1e-3)  # not half of it
