"""Adam(W) with quantized moments through prepare: torchao's algorithm bitwise, its optimizers within a
stated tolerance, bitwise resume, checkpoints across state precisions, the bytes it holds, the refusals."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import resumed, state_data, state_mlp
from mixprec._src.optim import adam, fused_adam, moments


def _torchao(name: str):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(name)


@pytest.fixture
def eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """mixprec's eager Adam step (``optim/adam.py``), the one written op for op as torchao's; the CPU kernel (the
    default on the CPU) is bitwise it but where torch's sqrt is not correctly rounded (tests/optim/test_cpu_adam.py),
    the compiled graph rounds differently (tests/optim/test_fused_adam.py)."""
    monkeypatch.setattr(fused_adam, "runs", lambda *_: False)


@pytest.fixture
def torchao_never_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's 8-bit and fp8 states with mixprec's one departure: a positive second moment is never stored as
    zero (tests/optim/test_quantize.py checks the departure alone). fp8: torchao casts both moments with one
    function; the second is the one without a negative value."""
    eight = _torchao("torchao.optim.subclass_8bit")
    fp8 = _torchao("torchao.optim.subclass_fp8")
    quantize_8bit, quantize_fp8 = eight.quantize_8bit_with_qmap, fp8.quantize_fp8

    def never_zero_8bit(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        codes = quantize_8bit(x, qmap)
        return torch.where((x > 0) & (codes == 0), 1, codes).to(torch.uint8) if qmap[0] == 0 else codes

    def never_zero_fp8(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = quantize_fp8(x, block_size)
        if (x >= 0).all():
            smallest = torch.tensor(2.0**-9, dtype=codes.dtype)
            codes = torch.where((x > 0) & (codes.float() == 0), smallest, codes)
        return codes, scale

    monkeypatch.setattr(eight, "quantize_8bit_with_qmap", never_zero_8bit)
    monkeypatch.setattr(fp8, "quantize_fp8", never_zero_fp8)


def _grads(steps: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) * 10.0 ** -(i % 4) for i in range(steps)]


def _state_zeros(precision: str, shape: torch.Size, signed: bool) -> Any:
    """torchao's zero state of ``precision``."""
    _, block = moments.FORMATS[precision]
    if precision == "fp8":
        return _torchao("torchao.optim.subclass_fp8").OptimStateFp8.zeros(shape, block)
    module = _torchao(f"torchao.optim.subclass_{precision}")
    return getattr(module, f"OptimState{precision}").zeros(shape, signed, block)


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("precision", ["8bit", "4bit", "fp8"])
@pytest.mark.usefixtures("torchao_never_zero", "eager_step")
def test_a_step_is_torchaos_single_param_adam_bitwise(precision: str, adamw: bool) -> None:
    ao_adam = _torchao("torchao.optim.adam")
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)
    theirs = model.weight.detach().clone()
    optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)(model.parameters(), lr=1e-2, weight_decay=0.1)
    mixprec.prepare(model, optimizer, "O1", optimizer_state=precision)
    m, v = _state_zeros(precision, theirs.shape, True), _state_zeros(precision, theirs.shape, False)
    step, lr = torch.tensor(0.0), torch.tensor(1e-2)
    for grad in _grads(5, theirs.shape):
        model.weight.grad = grad.clone()
        optimizer.step()
        step += 1
        ao_adam.single_param_adam(theirs, grad, step, m, v, None, lr, 0.9, 0.999, 0.1, 1e-8, adamw, False)
        assert torch.equal(model.weight.detach(), theirs)
    state = optimizer.state[model.weight]
    assert set(state) == set(adam.KEYS)
    assert state["exp_avg_codes"].dtype == (torch.float8_e4m3fn if precision == "fp8" else torch.uint8)
    assert torch.equal(state["exp_avg_codes"], m.codes.view(-1)) and torch.equal(
        state["exp_avg_sq_codes"], v.codes.view(-1)
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> list[float]:
    """Steps in a bf16 region (a prepared model opens its own: the unprepared reference computes the same)."""
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("precision", "theirs"), [("8bit", "AdamW8bit"), ("4bit", "AdamW4bit"), ("fp8", "AdamWFp8")])
@pytest.mark.usefixtures("torchao_never_zero", "eager_step")
def test_training_is_torchaos_low_bit_adamw_bitwise_where_every_parameter_is_quantized(
    precision: str, theirs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchao's optimizer run eagerly (its step compiles with inductor, whose arithmetic differs by roundings)."""
    optim = _torchao("torchao.optim")
    data = [(x, y.expand(-1, 16)) for x, y in state_data(12)]
    ours_model, their_model = _no_small_parameters(), _no_small_parameters()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=3e-3, weight_decay=0.01)
    mixprec.prepare(ours_model, ours_opt, "O1", optimizer_state=precision)
    ours = _train(ours_model, ours_opt, data)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    reference = _train(their_model, getattr(optim, theirs)(their_model.parameters(), lr=3e-3, weight_decay=0.01), data)
    assert ours == reference and ours[-1] < ours[0]


# torchao's step compiles a graph per parameter shape (8-15 s a precision on an empty inductor cache): make test
# runs 4-bit's; the eager differential above holds every precision bitwise there, and make test-slow runs all three.
@pytest.mark.parametrize(
    ("precision", "theirs"),
    [pytest.param("8bit", "AdamW8bit", marks=pytest.mark.slow), ("4bit", "AdamW4bit"),
     pytest.param("fp8", "AdamWFp8", marks=pytest.mark.slow)],
)  # fmt: skip
def test_training_follows_torchaos_compiled_low_bit_adamw(precision: str, theirs: str) -> None:
    """Within 2% a step: torchao's step compiled by inductor rounds differently, and mixprec steps the small
    parameters (biases, the 256-value head) with torch's own AdamW, which arranges the update differently from
    torchao's; a rounding that flips a code compounds (measured over 40 steps: 0.6% at most, both widths)."""
    optim = _torchao("torchao.optim")
    data = state_data(40)
    ours_model, their_model = state_mlp(), state_mlp()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=3e-3, weight_decay=0.01)
    mixprec.prepare(ours_model, ours_opt, "O1", optimizer_state=precision)
    ours = _train(ours_model, ours_opt, data)
    reference = _train(their_model, getattr(optim, theirs)(their_model.parameters(), lr=3e-3, weight_decay=0.01), data)
    assert ours[-1] < 0.5 * ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=0.02, atol=0)


def _no_small_parameters() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 256, bias=False), nn.GELU(),
                         nn.Linear(256, 16, bias=False))  # fmt: skip


@pytest.mark.parametrize(
    ("level", "precision"), [("O1", "8bit"), ("O2", "4bit"), ("bf16-pure", "8bit"), ("O1", "fp8"), ("bf16-sr", "4bit")]
)
def test_a_run_resumed_from_state_dicts_continues_bit_for_bit(level: str, precision: str) -> None:
    data = state_data(8)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = state_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        return mixprec.prepare(model, optimizer, level, optimizer_state=precision)

    model, optimizer = fresh()
    whole = _train(model, optimizer, data)
    model, optimizer = fresh()
    first = _train(model, optimizer, data[:4])
    model, optimizer, saved = resumed(model, optimizer, fresh)
    state = optimizer.state_dict()["state"][2]
    assert state["exp_avg_codes"].dtype == saved["optimizer"]["state"][2]["exp_avg_codes"].dtype  # as saved
    assert state["exp_avg_scale"].dtype == torch.float32
    assert first + _train(model, optimizer, data[4:]) == whole


def test_checkpoints_move_between_fp32_and_quantized_moments() -> None:
    data = state_data(6)
    plain = state_mlp()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    _train(plain, plain_opt, data[:3])
    model = copy.deepcopy(plain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mixprec.prepare(model, optimizer, "O1", optimizer_state="8bit")
    optimizer.load_state_dict(plain_opt.state_dict())  # fp32 moments: quantized at the next step
    _train(model, optimizer, data[3:5])
    state = optimizer.state[model[2].weight]
    assert moments.is_quantized(state) and "exp_avg" not in state and float(state["step"]) == 5
    assert not moments.is_quantized(optimizer.state[model[2].bias])  # small: fp32 moments, torch's own step
    mixprec.export_fp32(model, optimizer)  # back to fp32 moments a plain AdamW continues from
    state = optimizer.state[model[2].weight]
    assert state["exp_avg"].dtype == torch.float32 and not moments.is_quantized(state)
    _train(model, optimizer, data[5:])  # torch's own step on the exported moments


def test_quantized_moments_take_about_a_quarter_of_the_bytes() -> None:
    reports = {}
    for precision in ("fp32", "8bit", "4bit", "fp8"):
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
        optimizer = torch.optim.AdamW(model.parameters())
        mixprec.prepare(model, optimizer, "O1", optimizer_state=precision)
        _train(model, optimizer, [(torch.randn(4, 512), torch.randn(4, 512))])
        reports[precision] = mixprec.memory_report(model, optimizer)
    params = sum(p.numel() for p in model.parameters())
    per_param = {k: r.optimizer_state / params for k, r in reports.items()}
    assert 8.0 <= per_param["fp32"] < 8.01
    assert 2.0 < per_param["8bit"] < 2.1 and 1.0 < per_param["4bit"] < 1.1  # codes, block scales, fp32 biases
    assert per_param["fp8"] == per_param["8bit"]


def test_what_cannot_keep_quantized_moments_is_refused_with_what_to_do() -> None:
    model = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"quantizes SGD's momentum buffer .* this one has no momentum"):
        mixprec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", optimizer_state="8bit")
    with pytest.raises(ValueError, match="AdamW with amsgrad: use one of them"):
        mixprec.prepare(model, torch.optim.AdamW(model.parameters(), amsgrad=True), "O1", optimizer_state="4bit")
    with pytest.raises(
        ValueError, match=r"unknown optimizer_state '2bit'; valid optimizer states: fp32, bf16, 8bit, 4bit"
    ):
        mixprec.PrepareConfig("O1", optimizer_state="2bit")
    assert str(mixprec.PrepareConfig("O2", optimizer_state="4bit")).endswith("state=4bit")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, as intended
def test_a_run_resumed_from_a_distributed_checkpoint_continues_bit_for_bit(tmp_path: object) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = state_data(8)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = state_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        return mixprec.prepare(model, optimizer, "bf16-pure", optimizer_state="8bit")

    whole = _train(*fresh(), data)
    model, optimizer = fresh()
    first = _train(model, optimizer, data[:4])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    model, optimizer = fresh()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DCP steps once with lr 0 to make the state
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert optimizer.state[model[2].weight]["exp_avg_codes"].dtype == torch.uint8
    assert first + _train(model, optimizer, data[4:]) == whole


@pytest.mark.parametrize("precision", ["8bit", "fp8"])
def test_a_second_moment_stored_as_zero_would_blow_the_step_up_and_is_not(precision: str) -> None:
    """A gradient ten thousand times smaller than its block's largest, then exactly zero (a bf16 gradient that
    underflowed): torchao stores the first step's second moment as 0, and the second step divides the first
    moment by eps alone. mixprec keeps it positive, so the step stays about the learning rate."""
    ao_adam = _torchao("torchao.optim.adam")
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)
    theirs = model.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    mixprec.prepare(model, optimizer, "O1", optimizer_state=precision)
    m, v = _state_zeros(precision, theirs.shape, True), _state_zeros(precision, theirs.shape, False)
    first = torch.full(theirs.shape, 1e-4)  # its square is 1e-8 of the block's: below both formats' smallest step
    first[:, 0] = 1.0
    second = torch.zeros(theirs.shape)
    second[:, 0] = 1.0
    start = theirs.clone()
    for step, grad in enumerate((first, second), start=1):
        model.weight.grad = grad.clone()
        optimizer.step()
        ao_adam.single_param_adam(theirs, grad, torch.tensor(float(step)), m, v, None, torch.tensor(1e-2), 0.9, 0.999,
                                  0.0, 1e-8, True, False)  # fmt: skip
    assert (theirs - start).abs().max() > 10 * 1e-2  # torchao: the first moment over eps alone
    assert (model.weight.detach() - start).abs().max() < 3 * 1e-2


@pytest.mark.parametrize("precision", ["8bit", "fp8"])
def test_at_bf16_sr_the_weights_round_stochastically_with_the_levels_noise(precision: str) -> None:
    """An update a sixteenth of a bf16 step: rounded to nearest it is lost, rounded stochastically about a
    sixteenth of the weights move a whole step; the noise is bf16-sr's own (fp32 moments round the same)."""
    moved = {}
    for level, state in (("bf16-pure", precision), ("bf16-sr", precision), ("bf16-sr", "fp32")):
        model = nn.Linear(256, 64, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2.0**-11, weight_decay=0.0)  # bf16 steps 2**-7 at 1
        torch.manual_seed(0)  # bf16-sr draws its noise's seed from torch's generator
        mixprec.prepare(model, optimizer, level, optimizer_state=state)
        model.weight.grad = -torch.ones_like(model.weight)  # Adam's first step: lr in every element
        optimizer.step()
        moved[level, state] = model.weight.detach().float() - 1.0
    assert not moved["bf16-pure", precision].any()
    share = (moved["bf16-sr", precision] != 0).float().mean()
    assert 0.045 < share < 0.08 and set(moved["bf16-sr", precision].unique().tolist()) <= {0.0, 2.0**-7}
    assert torch.equal(moved["bf16-sr", precision], moved["bf16-sr", "fp32"])


def test_a_fused_adamw_keeps_its_fused_step_for_the_small_tensors() -> None:
    """fused=True (the bench's AdamW): the large tensors step quantized as with the plain AdamW, bit for bit; the
    small ones keep torch's fused step."""
    results = []
    for fused in (False, True):
        model = state_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused or None)
        mixprec.prepare(model, optimizer, "O1", optimizer_state="8bit")
        _train(model, optimizer, state_data(3))
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    large = [n for n, p in results[0].items() if p.numel() >= moments.MIN_NUMEL]
    assert large and all(torch.equal(results[0][n], results[1][n]) for n in large)
