"""bf16-kahan: bf16 weights whose updates carry what rounding drops in a bf16 compensation (optimi's method)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal
from mixprec._src.step import kahan


def test_the_write_carries_what_rounding_drops() -> None:
    """A thousand updates of 1e-4 to 3e-4 to weights at 1.0 (each below half a bf16 step, 2**-8):
    round-to-nearest keeps 1.0, 0.07 to 0.21 from the exact sum; the compensated weight follows it to within a
    bf16 step, and with its compensation to within half of one (the bf16 compensation's own rounding, about
    2e-6 a step, is what remains: measured 0.002)."""
    p = torch.ones(64, dtype=torch.bfloat16)
    comp = torch.zeros(64, dtype=torch.bfloat16)
    exact = torch.ones(64, dtype=torch.float64)
    for step in range(1000):
        update = 1e-4 * (1 + (torch.arange(64) % 3)) * (-1 if step % 7 == 0 else 1)
        kahan.write(p, p.float() + update, comp)
        exact += update.double()
    assert (p.double() - exact).abs().max() <= 2**-7  # within a bf16 step of the exact value
    assert ((p.double() + comp.double()) - exact).abs().max() < 2**-8
    assert (p.float() > 1.05).all()


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_bf16_pure_stalls_where_kahan_converges(cls: type[torch.optim.Optimizer]) -> None:
    results = {}
    for level in ("bf16-pure", "bf16-kahan", "O2"):
        torch.manual_seed(0)
        model = nn.Linear(1, 256, bias=False)
        nn.init.ones_(model.weight)
        opt = cls(model.parameters(), lr=0.02 if cls is torch.optim.SGD else 2e-4)  # updates below 2**-9
        mixprec.prepare(model, opt, level=level)
        x = torch.ones(1, 1)
        for _ in range(300):
            opt.zero_grad()
            F.mse_loss(model(x), torch.full((1, 256), 1.01), reduction="sum").backward()
            opt.step()
        results[level] = model.weight.float().mean().item()
    assert results["bf16-pure"] == 1.0  # stalled
    assert results["bf16-kahan"] == pytest.approx(results["O2"], abs=2**-7)  # where fp32 masters go, to a bf16 step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 4))  # fmt: skip


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 32, generator=g)
        opt.zero_grad()
        loss = (model(x) - x[:, :4].sin()).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
              "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}  # fmt: skip


@pytest.mark.parametrize("state", ["fp32", "8bit"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_compensation_is_state_and_a_resumed_run_continues_bit_for_bit(optimizer: str, state: str) -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model()
        opt = OPTIMIZERS[optimizer](model.parameters())
        return mixprec.prepare(model, opt, "bf16-kahan", optimizer_state=state)

    model, opt = fresh()
    whole = _train(model, opt, range(8))
    expected = [p.detach().clone() for p in model.parameters()]
    comps = [opt.state[p][kahan.COMP_KEY] for p in model.parameters() if p.dtype is torch.bfloat16]
    assert comps and all(c.dtype is torch.bfloat16 and c.abs().sum() > 0 for c in comps)
    model, opt = fresh()
    _train(model, opt, range(4))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    bf16 = sum(p.dtype is torch.bfloat16 for p in model.parameters())  # the kept LayerNorm steps in fp32
    assert sum(kahan.COMP_KEY in entry for entry in saved["opt"]["state"].values()) == bf16
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    rest = _train(model, opt, range(4, 8))
    assert rest == whole[4:]
    assert all(bitwise_equal(p.detach(), e) for p, e in zip(model.parameters(), expected, strict=True))


@pytest.mark.parametrize("decoupled", [True, False])
def test_the_fused_adam_kernel_is_torchs_step_with_the_compensated_write(decoupled: bool) -> None:
    """The kernel (compiled, as prepare runs it) against torch's Adam(W) stepping an fp32 copy from the same
    state, written back by kahan.write: the weight within one bf16 step, the compensation within its own."""
    from mixprec._src.step.sr_kernel import adam_scalars

    g = torch.Generator().manual_seed(0)
    p, grad, m, c = (torch.randn(4096, generator=g).mul(0.1).to(torch.bfloat16) for _ in range(4))
    c = c * 2**-9  # a compensation below half a step of the weights
    v = torch.rand(4096, generator=g).mul(1e-3).to(torch.bfloat16)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    shadow = p.float().requires_grad_()
    shadow.grad = grad.float()
    reference = cls([shadow], **group)  # type: ignore[arg-type]
    reference.state[shadow] = {"step": torch.tensor(4.0), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    reference.step()
    want_p, want_c = p.clone(), c.clone()
    kahan.write(want_p, shadow.detach(), want_c)
    kernel = kahan._kernel()
    assert kernel is not None
    with torch.no_grad():
        kernel(p, grad, m, v, c, adam_scalars(group, 5.0, decoupled))
    assert not torch.equal(p, want_p.new_zeros(()).expand_as(p))
    step = want_p.float().abs() * 2**-7
    assert ((p.float() - want_p.float()).abs() <= step).all()
    assert (p == want_p).float().mean() > 0.99
    assert ((p.float() + c.float()) - (want_p.float() + want_c.float())).abs().max() < 1e-5


def test_kahan_beats_round_to_nearest_and_steps_in_backward_alike() -> None:
    runs: dict[str, list[float]] = {}
    for name, options in {"bf16-pure": {"level": "bf16-pure"}, "bf16-kahan": {"level": "bf16-kahan"},
                          "in-backward": {"level": "bf16-kahan", "optimizer_state": "8bit", "step_in_backward": True},
                          "plain-8bit": {"level": "bf16-kahan", "optimizer_state": "8bit"},
                          "O2": {"level": "O2"}}.items():  # fmt: skip
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        level = options.pop("level")
        mixprec.prepare(model, opt, level, **options)
        runs[name] = _train(model, opt, range(60))
    assert runs["in-backward"] == runs["plain-8bit"]
    final = {name: sum(losses[-10:]) / 10 for name, losses in runs.items()}
    assert abs(final["bf16-kahan"] - final["O2"]) < abs(final["bf16-pure"] - final["O2"])


def test_export_puts_the_compensation_into_the_fp32_weights() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mixprec.prepare(model, opt, "bf16-kahan")
    _train(model, opt, range(3))
    expected = [p.detach().float() + opt.state[p][kahan.COMP_KEY].float() if p.dtype is torch.bfloat16
                else p.detach().clone() for p in model.parameters()]  # fmt: skip
    mixprec.export_fp32(model, opt)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert all(torch.equal(p.detach(), e) for p, e in zip(model.parameters(), expected, strict=True))
    assert all(kahan.COMP_KEY not in opt.state[p] for p in model.parameters())


def test_bf16_kahan_needs_bf16() -> None:
    with pytest.raises(ValueError, match="bf16-kahan"):
        mixprec.PrepareConfig(level="bf16-kahan", dtype=torch.float16)
