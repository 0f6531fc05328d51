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

import mixprec
from helpers import HostSyncs, OpNames, bitwise_equal, one_step, regression_data, regression_model, weights_seen
from mixprec._src.prepare.levels import prepared_state


def _train(level: str | None, steps: int = 150, lr: float = 3e-3, dtype: torch.dtype = torch.bfloat16,
           scaler: Any = None, model: nn.Module | None = None) -> tuple[float, nn.Module, Any]:  # fmt: skip
    model = model if model is not None else regression_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if level is not None:
        model, opt = mixprec.prepare(model, opt, level=level, dtype=dtype)
    losses = []
    for x, y in regression_data(steps):
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


def test_o2_layout_and_gradients() -> None:
    model = regression_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.prepare(model, opt, level="O2")
    # The parameters are the fp32 masters the optimizer steps; the forward computes with copies.
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(m) for m in mixprec.master_params(opt)]
    seen = weights_seen(model)
    x, y = regression_data(1)[0]
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
    seen = weights_seen(model)
    assert loss < 0.1
    # accumulation: two backward passes of different batches sum in fp32 on the parameter
    (x1, y1), (x2, y2) = regression_data(2, seed=9)
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
    model = regression_model()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": [p for m in list(model)[1:] for p in m.parameters()]}], lr=0.05)  # fmt: skip
    model, opt = mixprec.prepare(model, opt, level="O2")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = mixprec.GradScaler("cpu")
    for i, (x, y) in enumerate(regression_data(4)):
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
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = mixprec.prepare(model, opt, level="O2", dtype=torch.float16)
        return model, opt, mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    def steps(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()

    batches = regression_data(20)
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
    fp32_model = regression_model()
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    one_step(fp32_model, fp32_opt)
    _, o2_model, o2_opt = _train("O2", steps=3)
    o2_state, plain_state = o2_model.state_dict(), fp32_model.state_dict()
    assert {k: v.dtype for k, v in o2_state.items()} == {k: v.dtype for k, v in plain_state.items()}
    # the optimizer's layout is torch's, with the two stochastic-rounding counters every level carries
    o2_keys = o2_opt.state_dict()["param_groups"][0].keys()
    assert o2_keys == fp32_opt.state_dict()["param_groups"][0].keys() | {"mixprec_sr_seed", "mixprec_sr_step"}
    fp32_model.load_state_dict(o2_state)  # O2 -> fp32
    fp32_opt.load_state_dict(o2_opt.state_dict())
    assert bitwise_equal(list(fp32_model.parameters()), list(o2_model.parameters()))
    model = regression_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.prepare(model, opt, level="O2")
    model.load_state_dict(plain_state)  # fp32 -> O2
    opt.load_state_dict(fp32_opt.state_dict())
    assert bitwise_equal(list(model.parameters()), [plain_state[n] for n, _ in model.named_parameters()])
    seen = weights_seen(model)
    model(regression_data(1)[0][0])
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
    seen = weights_seen(model)
    model(tokens)
    for name, (dtype, weight) in seen.items():  # the forward computes with the updated weights
        assert dtype is torch.bfloat16 and torch.equal(weight, model.get_submodule(name).weight.to(dtype)), name


@pytest.mark.parametrize("level", ["O2", "bf16-sr"])
def test_export_fp32(level: str) -> None:
    _, model, opt = _train(level, steps=10)
    masters = [m.detach().float() for m in mixprec.master_params(opt)]
    mixprec.export_fp32(model, opt)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert bitwise_equal([p.detach() for p in model.parameters()], masters)
    assert not hasattr(model, "_mixprec")
    assert all(k not in g for g in opt.param_groups for k in ("mixprec_sr_seed", "mixprec_sr_step"))
    seen = weights_seen(model)
    x, y = regression_data(1)[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()  # trains on in fp32
    opt.step()
    assert model(x).dtype is torch.float32
    assert all(dtype is torch.float32 for dtype, _ in seen.values())  # the forward is fp32 again


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (lambda: regression_model().to(torch.bfloat16), {}, "needs an fp32 model"),
        (lambda: regression_model(), {"level": "O3"}, "unknown level 'O3'; valid levels: O1, O2, bf16-sr"),
        (lambda: regression_model(), {"level": "bf16-sr", "dtype": torch.float16}, "keeps weights in bf16"),
        (lambda: regression_model(), {"dtype": torch.int8}, "non-floating"),
    ],
)
def test_bad_input(make: Any, kwargs: dict[str, Any], match: str) -> None:
    model = make()
    with pytest.raises(ValueError, match=match):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert not hasattr(model, "_mixprec")
    assert all(p.dtype is model[0].weight.dtype for p in model.parameters())  # nothing converted


def test_optimizer_not_over_this_model_or_shared_params() -> None:
    model = regression_model()
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


# ----- weights written into a prepared model (O2) ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_weights_loaded_after_prepare_reach_the_forward(dtype: torch.dtype) -> None:
    pretrained = regression_model(seed=5).state_dict()  # fp32, unlike the weights prepare() started from
    model = regression_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the step must keep what was loaded
    model, opt = mixprec.prepare(model, opt, level="O2", dtype=dtype)
    seen = weights_seen(model)
    model.load_state_dict(pretrained)
    model(regression_data(1)[0][0])  # before any step: the copies follow the load
    for name in ("0", "3", "5"):
        assert bitwise_equal(seen[name][1], pretrained[f"{name}.weight"].to(dtype)), name
    one_step(model, opt)
    for name, param in model.named_parameters():
        assert bitwise_equal(param.detach(), pretrained[name]), name  # the fp32 values, not a low-precision trip


def test_o2_in_place_writes_reach_the_forward() -> None:
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = mixprec.prepare(model, opt, level="O2")
    seen = weights_seen(model)
    x = regression_data(1)[0][0]
    model(x)
    written = torch.randn(64, 16)
    with torch.no_grad():
        model[0].weight.copy_(written)
        nn.init.zeros_(model[5].weight)
    model(x)
    assert bitwise_equal(seen["0"][1], written.to(torch.bfloat16))
    assert bitwise_equal(seen["5"][1], torch.zeros(1, 64, dtype=torch.bfloat16))


def test_o2_parameters_replaced_after_prepare_raise() -> None:
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    model.load_state_dict(regression_model(seed=5).state_dict(), assign=True)  # new Parameter objects
    with pytest.raises(RuntimeError, match=r"replaced after mixprec.prepare .*no longer steps it"):
        model(regression_data(1)[0][0])
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
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level=level, dtype=dtype)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    x, y = regression_data(1)[0]
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
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    x, y = regression_data(1)[0]
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype is torch.float32 for g in grads)
    assert [id(g) for g in grads] == [id(m.grad) for m in mixprec.master_params(opt)]
    model.zero_grad()
    assert all(p.grad is None for p in (*model.parameters(), *mixprec.master_params(opt)))


# ----- bf16-sr: checkpoints, schedulers and hooks ----------------------------------------------


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
    model = regression_model()
    model, opt = mixprec.prepare(model, cls(model.parameters(), lr=1e-2), level=level)  # type: ignore[call-arg]
    for i, (x, y) in enumerate(regression_data(4)):
        if i == 0:  # the first step compiles bf16-sr's fused kernel for these shapes: a one-time cost
            one_step(model, opt)
            continue
        with host_syncs:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        steps = tuple(s["step"] for s in opt.state.values() if "step" in s)
        assert host_syncs.names(ignore=steps) == []


@pytest.mark.parametrize("optimizer", ["rmsprop", "sgd"])
def test_o2_refreshes_its_copies_once_per_step_in_one_fused_copy(optimizer: str) -> None:
    """The docs' claim: one multi-tensor copy for every optimizer.step(), made by the first forward after it, none
    in the forwards that follow; none at all where the step's own kernel wrote every copy (SGD on the CPU)."""
    model = regression_model()
    kind = torch.optim.RMSprop if optimizer == "rmsprop" else torch.optim.SGD
    model, opt = mixprec.prepare(model, kind(model.parameters(), lr=0.1), level="O2")
    (x, y), _ = regression_data(2)
    F.mse_loss(model(x), y).backward()
    with OpNames() as during_step:
        opt.step()
    with OpNames() as first_forward:
        model(x)
    with OpNames() as during_forward:
        model(x)
    assert "_foreach_copy_" not in during_step.names
    refreshes = 1 if optimizer == "rmsprop" else 0
    assert first_forward.names.count("_foreach_copy_") == refreshes and "copy_" not in first_forward.names
    assert "copy_" not in during_forward.names and "_foreach_copy_" not in during_forward.names


def test_a_compiled_o2_forward_leaves_the_eager_copies_alone() -> None:
    """Compiled, the forward casts the masters in its graph: the step's refresh of the eager copies is not made."""
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.prepare(model, opt, level="O2")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    (x, y), _ = regression_data(2)
    state = prepared_state(model)
    assert state is not None and state.copies is not None
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(compiled(x), y).backward()
        opt.step()
        assert state.copies.behind
    eager = model(x)
    assert not state.copies.behind
    torch.testing.assert_close(eager, compiled(x), rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-sr"])
def test_an_outer_autocast_of_another_dtype_is_told_once_and_the_model_keeps_its_own(level: str) -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model, _ = mixprec.prepare(model, torch.optim.AdamW(model.parameters()), level=level, dtype=torch.bfloat16)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)  # no outer region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)  # the same dtype: nothing to say
        assert not caught
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                model(x)
    assert seen == [torch.bfloat16] * 5  # as prepared, whatever the outer region
    (told,) = caught  # once per model, at the user's call
    assert "prepared to compute in bf16 and runs inside an autocast region of fp16" in str(told.message)
    assert "prepare it with dtype='fp16'" in str(told.message) and told.filename == __file__
