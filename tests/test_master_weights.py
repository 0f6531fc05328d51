"""prepare(): O2 master weights, bf16 with stochastic rounding, and their bookkeeping."""

from __future__ import annotations

import copy
import inspect
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import mixprec
from conftest import HostSyncs, bitwise_equal
from mixprec._src import stochastic_rounding


def _model(seed: int = 0, norm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, 64)]
    if norm:
        layers.append(nn.LayerNorm(64))
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def _data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 1, generator=g) / 4
    batches = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=g)
        batches.append((x, torch.sin(x @ teacher)))
    return batches


def _train(level: str | None, steps: int = 150, lr: float = 3e-3, dtype: torch.dtype = torch.bfloat16,
           scaler: Any = None, model: nn.Module | None = None) -> tuple[float, nn.Module, Any]:  # fmt: skip
    model = model if model is not None else _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if level is not None:
        model, opt = mixprec.prepare(model, opt, level=level, dtype=dtype)
    losses = []
    for x, y in _data(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10, model, opt


@pytest.fixture(scope="module")
def fp32_loss() -> float:
    return _train(None)[0]


@pytest.mark.slow  # a convergence run per level
def test_levels_reach_fp32_loss(fp32_loss: float) -> None:
    assert fp32_loss < 0.05  # the problem is learnt
    o2 = _train("O2")[0]
    sr = _train("bf16-sr")[0]
    assert abs(o2 - fp32_loss) / fp32_loss < 0.02, (o2, fp32_loss)
    assert abs(sr - fp32_loss) / fp32_loss < 0.03 or sr < fp32_loss * 1.03, (sr, fp32_loss)


def _weights_seen(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    """Each module's weight as its own forward sees it (dtype and value), recorded by a hook."""
    seen: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if "weight" in module._parameters:
            module.register_forward_pre_hook(
                lambda m, a, name=name: seen.__setitem__(name, (m.weight.dtype, m.weight.detach().clone()))
            )
    return seen


def test_o2_layout_and_gradients() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.prepare(model, opt, level="O2")
    # The parameters are the fp32 masters the optimizer steps; the forward computes with copies.
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(m) for m in mixprec.master_params(opt)]
    seen = _weights_seen(model)
    x, y = _data(1)[0]
    out = model(x)
    assert out.dtype is torch.float32
    assert {name: dtype for name, (dtype, _) in seen.items()} == {
        "0": torch.bfloat16, "1": torch.float32, "3": torch.bfloat16, "5": torch.bfloat16  # the norm kept in fp32
    }  # fmt: skip
    assert all(p.dtype is torch.float32 for p in model.parameters())  # swapped back after the forward
    F.mse_loss(out, y).backward()
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in model.parameters())
    opt.step()
    model(x)
    for name, (_, weight) in seen.items():  # the next forward computes with copies of the updated weights
        assert bitwise_equal(weight, model.get_submodule(name).weight.detach().to(weight.dtype)), name
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_o2_matches_o1_bit_for_bit() -> None:
    # Both round the fp32 weights to nearest before every forward and sum fp32 gradients: the same
    # numbers, step after step (this MLP has no op that O2's bf16 weights would change).
    _, o1, _ = _train("O1", steps=20)
    _, o2, _ = _train("O2", steps=20)
    assert bitwise_equal([p.detach() for p in o1.parameters()], [p.detach() for p in o2.parameters()])


def test_o2_with_grad_scaler_fp16_and_accumulation() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12)
    loss, model, opt = _train("O2", steps=60, lr=3e-3, dtype=torch.float16, scaler=scaler)
    seen = _weights_seen(model)
    assert loss < 0.1
    # accumulation: two backward passes of different batches sum in fp32 on the parameter
    (x1, y1), (x2, y2) = _data(2, seed=9)
    grads = []
    for x, y in ((x1, y1), (x2, y2)):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append(model[0].weight.grad.clone())  # type: ignore[union-attr]
    assert seen["0"][0] is torch.float16
    opt.zero_grad()
    F.mse_loss(model(x1), y1).backward()
    F.mse_loss(model(x2), y2).backward()
    want = grads[0] + grads[1]
    assert not torch.equal(want.half().float(), want)  # a sum fp16 could not hold: the test can tell
    assert torch.equal(model[0].weight.grad, want)


def test_param_groups_scheduler_clipping_and_zero_grad_modes() -> None:
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": [p for m in list(model)[1:] for p in m.parameters()]}], lr=0.05)  # fmt: skip
    model, opt = mixprec.prepare(model, opt, level="O2")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = mixprec.GradScaler("cpu")
    for i, (x, y) in enumerate(_data(4)):
        opt.zero_grad(set_to_none=i % 2 == 0)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), 1e-3)
        assert norm > 1e-3
        assert torch.nn.utils.get_total_norm([m.grad for m in mixprec.master_params(opt)]) <= 1e-3 * 1.01
        scaler.step(opt)
        scaler.update()
        scaler.step_scheduler(sched)
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**4


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["model-first", "optimizer-first"])
def test_o2_checkpoint_resumes_bit_for_bit(optimizer_first: bool) -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, mixprec.GradScaler]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = mixprec.prepare(model, opt, level="O2", dtype=torch.float16)
        return model, opt, mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    def steps(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()

    batches = _data(20)
    straight = fresh()
    steps(*straight, batches)
    first = fresh()
    steps(*first, batches[:10])
    buffer = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[1].state_dict(), "scaler": first[2].state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = fresh()
    # Either order: the model's low-precision weights leave alone masters that already round to them.
    if optimizer_first:
        resumed[1].load_state_dict(saved["opt"])
    resumed[0].load_state_dict(saved["model"])
    if not optimizer_first:
        resumed[1].load_state_dict(saved["opt"])
    resumed[2].load_state_dict(saved["scaler"])
    steps(*resumed, batches[10:])
    assert bitwise_equal(mixprec.master_params(straight[1]), mixprec.master_params(resumed[1]))
    assert bitwise_equal(list(straight[0].parameters()), list(resumed[0].parameters()))
    assert all(v.dtype is torch.float32 for v in saved["model"].values())  # the weights at full precision


def test_o2_checkpoints_are_plain_fp32_checkpoints() -> None:
    # An O2 run saves what an fp32 run saves (names, dtypes, optimizer layout), so either loads the other.
    fp32_model = _model()
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    _one_step(fp32_model, fp32_opt)
    _, o2_model, o2_opt = _train("O2", steps=3)
    o2_state, plain_state = o2_model.state_dict(), fp32_model.state_dict()
    assert {k: v.dtype for k, v in o2_state.items()} == {k: v.dtype for k, v in plain_state.items()}
    # the optimizer's layout is torch's, with the two stochastic-rounding counters every level carries
    o2_keys = o2_opt.state_dict()["param_groups"][0].keys()
    assert o2_keys == fp32_opt.state_dict()["param_groups"][0].keys() | {"mixprec_sr_seed", "mixprec_sr_step"}
    fp32_model.load_state_dict(o2_state)  # O2 -> fp32
    fp32_opt.load_state_dict(o2_opt.state_dict())
    assert bitwise_equal(list(fp32_model.parameters()), list(o2_model.parameters()))
    model = _model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.prepare(model, opt, level="O2")
    model.load_state_dict(plain_state)  # fp32 -> O2
    opt.load_state_dict(fp32_opt.state_dict())
    assert bitwise_equal(list(model.parameters()), [plain_state[n] for n, _ in model.named_parameters()])
    seen = _weights_seen(model)
    model(_data(1)[0][0])
    assert bitwise_equal(seen["0"][1], plain_state["0.weight"].to(torch.bfloat16))  # the forward uses what was loaded


def _optimizers() -> list[Any]:
    found = []
    for name, cls in inspect.getmembers(torch.optim, inspect.isclass):
        if issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            found.append(pytest.param(cls, id=name))
    return found


@pytest.mark.parametrize("cls", _optimizers())
def test_every_torch_optimizer_at_o2(cls: type[torch.optim.Optimizer]) -> None:
    torch.manual_seed(0)
    sparse = cls is torch.optim.SparseAdam
    embed = nn.Embedding(32, 8, sparse=sparse)
    model = nn.Sequential(embed, nn.Flatten(), nn.Linear(32, 1))
    params = list(embed.parameters()) if sparse else list(model.parameters())
    if cls.__name__ == "Muon":  # Muon orthogonalises matrices: 2-D parameters only
        params = [p for p in params if p.dim() == 2]
    opt = cls(params, lr=1e-2) if cls is not torch.optim.LBFGS else cls(params, lr=0.1)
    if cls is torch.optim.LBFGS:
        with pytest.raises(ValueError, match="LBFGS"):
            mixprec.prepare(model, opt, level="O2")
        return
    model, opt = mixprec.prepare(model, opt, level="O2")
    tokens = torch.randint(0, 32, (16, 4))
    target = torch.randn(16, 1)
    before = [m.detach().clone() for m in mixprec.master_params(opt)]
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(tokens), target).backward()
        opt.step()
    after = mixprec.master_params(opt)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), "nothing was updated"
    seen = _weights_seen(model)
    model(tokens)
    for name, (dtype, weight) in seen.items():  # the forward computes with the updated weights
        assert dtype is torch.bfloat16 and torch.equal(weight, model.get_submodule(name).weight.to(dtype)), name


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
    seeds = [torch.tensor(stochastic_rounding.tensor_seed(12345, step, 0), dtype=torch.int32) for step in range(steps)]
    draws = torch.stack([stochastic_rounding.sr_bits(x, seed).view(torch.float32) for seed in seeds])
    assert set(draws.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert (draws.mean(0) - x).abs().max() < 0.06 * 2**-7  # every element, on average over steps
    # and within one step, about 3/8 of the elements round up
    assert abs(draws.gt(1.0).float().mean(1) - 0.375).max() < 0.1


def test_fused_adam_sr_kernel_matches_its_eager_form() -> None:
    torch.manual_seed(0)
    p, g, m, v = (torch.randn(1000).mul(0.1).to(torch.bfloat16) for _ in range(4))
    v = v.abs()
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    seed = torch.tensor(stochastic_rounding.tensor_seed(7, 1, 0), dtype=torch.int32)
    scalars = stochastic_rounding.adam_scalars(group, 3.0, True)
    eager = [t.clone() for t in (p, g, m, v)]
    stochastic_rounding.adam_sr_update(*eager, seed, scalars)
    compiled = [t.clone() for t in (p, g, m, v)]
    torch.compile(stochastic_rounding.adam_sr_update, fullgraph=True, dynamic=True)(*compiled, seed, scalars)
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


@pytest.mark.parametrize("level", ["O2", "bf16-sr"])
def test_export_fp32(level: str) -> None:
    _, model, opt = _train(level, steps=10)
    masters = [m.detach().float() for m in mixprec.master_params(opt)]
    mixprec.export_fp32(model, opt)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert bitwise_equal([p.detach() for p in model.parameters()], masters)
    assert not hasattr(model, "_mixprec")
    assert all(k not in g for g in opt.param_groups for k in ("mixprec_sr_seed", "mixprec_sr_step"))
    seen = _weights_seen(model)
    x, y = _data(1)[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()  # trains on in fp32
    opt.step()
    assert model(x).dtype is torch.float32
    assert all(dtype is torch.float32 for dtype, _ in seen.values())  # the forward is fp32 again


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (lambda: _model().to(torch.bfloat16), {}, "needs an fp32 model"),
        (lambda: _model(), {"level": "O3"}, "unknown level 'O3'; valid levels: O1, O2, bf16-sr"),
        (lambda: _model(), {"level": "bf16-sr", "dtype": torch.float16}, "keeps weights in bf16"),
        (lambda: _model(), {"dtype": torch.int8}, "non-floating"),
    ],
)
def test_bad_input(make: Any, kwargs: dict[str, Any], match: str) -> None:
    model = make()
    with pytest.raises(ValueError, match=match):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert not hasattr(model, "_mixprec")
    assert all(p.dtype is model[0].weight.dtype for p in model.parameters())  # nothing converted


def test_optimizer_not_over_this_model_or_shared_params() -> None:
    model = _model()
    stale = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)  # e.g. built before a copy or move
    with pytest.raises(ValueError, match=r"not a parameter of this model.*after moving the model"):
        mixprec.prepare(model, stale)
    shared = torch.optim.SGD([{"params": list(model.parameters())}], lr=0.1)
    shared.param_groups.append({**shared.param_groups[0], "params": [next(model.parameters())]})
    with pytest.raises(ValueError, match="two optimizer param groups"):
        mixprec.prepare(model, shared)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mixprec.prepare(model, opt)
    with pytest.raises(ValueError, match="already prepared"):
        mixprec.prepare(model, opt)


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


# ----- weights written into a prepared model (O2) ----------------------------------------------


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = _data(1)[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_weights_loaded_after_prepare_reach_the_forward(dtype: torch.dtype) -> None:
    pretrained = _model(seed=5).state_dict()  # fp32, unlike the weights prepare() started from
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the step must keep what was loaded
    model, opt = mixprec.prepare(model, opt, level="O2", dtype=dtype)
    seen = _weights_seen(model)
    model.load_state_dict(pretrained)
    model(_data(1)[0][0])  # before any step: the copies follow the load
    for name in ("0", "3", "5"):
        assert bitwise_equal(seen[name][1], pretrained[f"{name}.weight"].to(dtype)), name
    _one_step(model, opt)
    for name, param in model.named_parameters():
        assert bitwise_equal(param.detach(), pretrained[name]), name  # the fp32 values, not a low-precision trip


def test_o2_in_place_writes_reach_the_forward() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = mixprec.prepare(model, opt, level="O2")
    seen = _weights_seen(model)
    x = _data(1)[0][0]
    model(x)
    written = torch.randn(64, 16)
    with torch.no_grad():
        model[0].weight.copy_(written)
        nn.init.zeros_(model[5].weight)
    model(x)
    assert bitwise_equal(seen["0"][1], written.to(torch.bfloat16))
    assert bitwise_equal(seen["5"][1], torch.zeros(1, 64, dtype=torch.bfloat16))


def test_o2_parameters_replaced_after_prepare_raise() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    model.load_state_dict(_model(seed=5).state_dict(), assign=True)  # new Parameter objects
    with pytest.raises(RuntimeError, match=r"replaced after mixprec.prepare .*no longer steps it"):
        model(_data(1)[0][0])
    with pytest.raises(mixprec.PrepareOrderError, match="no longer this model's parameters"):
        opt.step()


# ----- gradients seen through model.parameters() -----------------------------------------------


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "GradScaler"])
@pytest.mark.parametrize(
    ("level", "dtype"),
    [
        ("O1", torch.bfloat16),
        ("O2", torch.bfloat16),
        ("O2", torch.float16),
        ("bf16-sr", torch.bfloat16),
        ("bf16-pure", torch.bfloat16),
    ],
)
def test_clipping_model_parameters_clips_the_update(level: str, dtype: torch.dtype, scaled: bool) -> None:
    # clip_grad_norm_(model.parameters()) after unscale_ (the AMP recipe), checked against a norm and a
    # clipped SGD update computed here in fp64 from the gradients the step is given: the norm is every
    # gradient's, and the step moves each weight by -lr * its clipped gradient.
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level=level, dtype=dtype)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    x, y = _data(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    grads = [p.grad.double().clone() for p in model.parameters()]  # type: ignore[union-attr]
    want_norm = torch.cat([g.flatten() for g in grads]).norm()
    before = [p.detach().double().clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-2)
    assert want_norm > 1e-2  # the clip does something
    # torch computes the norm in the gradients' dtype: fp32 gradients to 1e-6, bf16 ones to a bf16 step
    bf16_grads = level in ("bf16-sr", "bf16-pure")
    torch.testing.assert_close(norm.double(), want_norm, rtol=2.0**-7 if bf16_grads else 1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    factor = 1e-2 / (norm.double() + 1e-6)  # torch's clip coefficient, from the norm it computed
    for param, start, grad in zip(model.parameters(), before, grads, strict=True):
        want = start - 0.1 * (grad * factor).to(param.grad.dtype).double()  # type: ignore[union-attr]
        # fp32 weights: fp32 arithmetic; bf16 weights: the update rounds to one of the two neighbours (bf16-sr)
        ulp = 2.0**-7 if param.dtype is torch.bfloat16 else 1e-6
        assert ((param.detach().double() - want).abs() <= ulp * want.abs() + 1e-7).all()
        moved = (param.detach().double() - start).abs().max()
        unclipped = (0.1 * grad).abs().max()
        assert moved < unclipped / 2 or unclipped == 0  # the step took the clipped gradient, not the raw one


def test_o2_gradient_seen_through_the_model_is_the_optimizers() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    x, y = _data(1)[0]
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype is torch.float32 for g in grads)
    assert [id(g) for g in grads] == [id(m.grad) for m in mixprec.master_params(opt)]
    model.zero_grad()
    assert all(p.grad is None for p in (*model.parameters(), *mixprec.master_params(opt)))


# ----- bf16-sr: checkpoints, schedulers and hooks ----------------------------------------------


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
        model = _model(seed)
        return mixprec.prepare(model, make(model.parameters()), level="bf16-sr")

    def steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    batches = _data(12)
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


def _sr(cls: type[torch.optim.Optimizer]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    model, opt = mixprec.prepare(model, cls(model.parameters(), lr=1e-2), level="bf16-sr")  # type: ignore[call-arg]
    assert opt._mixprec.fused is (cls is torch.optim.AdamW)  # type: ignore[attr-defined]
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    return [[p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())]


@pytest.mark.parametrize("norm", [False, True], ids=["all-bf16", "fp32-norm-kept"])
@pytest.mark.parametrize("created", ["before-prepare", "after-prepare"])
def test_bf16_sr_adam_with_lr_scheduler(created: str, norm: bool) -> None:
    model = _model(norm=norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)

    sched = schedule(opt) if created == "before-prepare" else None
    model, opt = mixprec.prepare(model, opt, level="bf16-sr")
    assert opt._mixprec.fused  # type: ignore[attr-defined]
    sched = sched or schedule(opt)
    start = _snapshot(model, opt)[0]
    _one_step(model, opt)
    sched.step()  # warnings are errors: none about the order of step() calls
    first = _snapshot(model, opt)[0]
    assert all(not torch.equal(a, b) for a, b in zip(start, first, strict=True))  # lr 1e-2 moves every weight
    assert opt.param_groups[0]["lr"] == 0.0
    _one_step(model, opt)
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
        _one_step(model, opt)
    finally:
        for handle in handles:
            handle.remove()
    assert [name for name, _ in seen] == ["global-pre", "pre", "post"]
    assert torch.equal(seen[0][1], before) and torch.equal(seen[1][1], before)
    assert not torch.equal(seen[2][1], before)  # the post hook sees the update


@pytest.mark.parametrize("cls", SR_PATHS)
def test_bf16_sr_raising_pre_hook_prevents_the_update(cls: type[torch.optim.Optimizer]) -> None:
    model, opt = _sr(cls)
    _one_step(model, opt)

    def refuse(*_: Any) -> None:
        raise RuntimeError("refused by a pre-hook")

    handle = opt.register_step_pre_hook(refuse)
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="refused by a pre-hook"):
        _one_step(model, opt)
    assert bitwise_equal(_snapshot(model, opt), before)
    handle.remove()
    _one_step(model, opt)
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
    _one_step(model, opt)
    handle = opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="refused by a pre-hook"):
        _one_step(model, opt)
    handle.remove()
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    want_model, want_opt = fresh()
    _one_step(want_model, want_opt)
    for m, o in ((model, opt), (want_model, want_opt)):
        x, y = _data(2)[1]
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
        x, y = _data(1)[0]
        F.mse_loss(model(x), y).backward()
        if not clip_in_hook:
            clip()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    assert bitwise_equal(run(clip_in_hook=True), run(clip_in_hook=False))


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
def test_modules_kept_by_name_compute_in_fp32(level: str) -> None:
    # prepare's region opens inside the model's call; names still resolve from the model.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.big, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            self.seen = (h.dtype, self.big(h).dtype)
            return self.head(h)

    model = Net()
    model, _ = mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), level=level, keep_names="big")
    model(torch.randn(2, 8))
    assert model.seen == (torch.bfloat16, torch.float32)
    assert model.big.weight.dtype is torch.float32


@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-pure"])
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW], ids=["SGD", "AdamW"])
def test_training_steps_read_no_device_data(
    level: str, cls: type[torch.optim.Optimizer], host_syncs: HostSyncs
) -> None:
    # O2's copies and version checks, bf16-sr's seeds and write-back: nothing reads tensor data on the host.
    # The only reads are of Adam's step counts, which torch and the fused bf16-sr step keep on the CPU.
    model = _model()
    model, opt = mixprec.prepare(model, cls(model.parameters(), lr=1e-2), level=level)  # type: ignore[call-arg]
    for i, (x, y) in enumerate(_data(4)):
        if i == 0:  # the first step compiles bf16-sr's fused kernel for these shapes: a one-time cost
            _one_step(model, opt)
            continue
        with host_syncs:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        steps = tuple(s["step"] for s in opt.state.values() if "step" in s)
        assert host_syncs.names(ignore=steps) == []


# --- PrepareConfig: the one description of a conversion ---------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr", "bf16-pure"])
def test_a_config_prepares_as_the_same_options_do(level: str) -> None:
    runs = []
    for as_config in (False, True):
        torch.manual_seed(7)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if as_config:
            config = mixprec.PrepareConfig(level=level, keep_names=("2",), output_dtype=None)  # type: ignore[arg-type]
            model, opt = mixprec.prepare(model, opt, config)
        else:
            model, opt = mixprec.prepare(model, opt, level, keep_names="2", output_dtype=None)
        for x, y in _data(3):
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert bitwise_equal(runs[0], runs[1])


def test_keep_filter_keeps_the_modules_it_accepts_in_fp32() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    config = mixprec.PrepareConfig(level="O2", keep_filter=lambda module, name: name == "5")  # type: ignore[arg-type]
    model, opt = mixprec.prepare(model, opt, config)
    seen = _weights_seen(model)
    assert model(_data(1)[0][0]).dtype is torch.float32
    assert {name: dtype for name, (dtype, _) in seen.items()} == {
        "0": torch.bfloat16, "1": torch.float32, "3": torch.bfloat16, "5": torch.float32  # the norm, and the head
    }  # fmt: skip


def test_the_configs_policy_reaches_the_prepared_forward() -> None:
    # every Linear moved to fp32: at O1 the prepared model computes what the fp32 model computes
    policy = mixprec.get_policy("cpu").add("fp32", "linear", "addmm", "mm", "matmul")
    x = _data(1)[0][0]
    want = _model()(x)
    for chosen, equal in ((policy, True), (None, False)):
        model = _model()
        config = mixprec.PrepareConfig(level="O1", policy=chosen)  # type: ignore[arg-type]
        model, _ = mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        assert bitwise_equal(model(x), want) is equal


def test_a_config_checks_itself_and_is_not_mixed_with_options() -> None:
    with pytest.raises(ValueError, match="level 'bf16-sr' keeps weights in bf16"):
        mixprec.PrepareConfig(level="bf16-sr", dtype="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown level 'O3'"):
        mixprec.PrepareConfig(level="O3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_filter must be a callable"):
        mixprec.PrepareConfig(keep_filter="head")  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(TypeError, match="a PrepareConfig or options, not both"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), mixprec.PrepareConfig(), keep_names="2")
    config = mixprec.PrepareConfig(level="O2", keep_types=nn.LayerNorm, keep_names="5")  # type: ignore[arg-type]
    assert config.keep_types == (nn.LayerNorm,) and config.keep_names == ("5",)
    assert str(config) == "O2 bf16, keep=LayerNorm+'5', output=fp32"
    assert str(mixprec.PrepareConfig()) == "O2 bf16, keep=norm, output=fp32"


def test_o2_refreshes_its_copies_once_per_step_in_one_fused_copy() -> None:
    """The docs' claim: one fused copy after every optimizer.step(), none in the forwards that follow."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    (x, y), _ = _data(2)
    F.mse_loss(model(x), y).backward()
    with Ops() as during_step:
        opt.step()
    with Ops() as during_forward:
        model(x)
        model(x)
    assert during_step.names.count("_foreach_copy_") == 1
    assert "copy_" not in during_forward.names and "_foreach_copy_" not in during_forward.names
