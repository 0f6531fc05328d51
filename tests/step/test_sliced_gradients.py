"""Large weights' gradients made and stepped a slice of rows at a time in backward (``step_in_backward=True`` with
quantized Adam(W) state): bitwise the whole gradient's step, never a whole gradient alive, and where it steps
aside (a layer called twice, a dropped graph, checkpointing, torch.compile, what it does not take)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import mixprec
from helpers import bitwise_equal
from mixprec._src.step import low_bit_state, sliced_gradients, step_in_backward

SMALL = 1024  # values a slice holds in these tests: 8 rows of a 128-wide weight (4 blocks of 256 values)


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_gradients, "SLICE", SMALL)


class _Net(nn.Module):
    """Two large linears, a norm, a small head; ``twice``: the middle linear called two times."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm = nn.Linear(64, 128), nn.LayerNorm(128)
        self.b, self.head = nn.Linear(128, 128), nn.Linear(128, 10)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.a(x)))
        h = F.gelu(self.b(h))
        if self.twice:
            h = F.gelu(self.b(h))
        return self.head(h)  # type: ignore[no-any-return]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _prepared(whole: bool, monkeypatch: pytest.MonkeyPatch, level: str = "bf16-sr", state: str = "8bit",
              optimizer: str = "adamw", model: nn.Module | None = None,
              **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:  # fmt: skip
    model = _Net() if model is None else model
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = kind(model.parameters(), lr=1e-2, weight_decay=0.01)
    with monkeypatch.context() as patch:
        if whole:
            patch.setattr(sliced_gradients, "SLICE", 1 << 40)
        mixprec.prepare(model, opt, level, optimizer_state=state, step_in_backward=True, **options)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, first: int = 0) -> list[torch.Tensor]:
    for step in range(first, first + steps):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sliced(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if sliced_gradients.is_sliced(m)]


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    ours, theirs = a.state_dict()["state"], b.state_dict()["state"]
    return sorted(ours) == sorted(theirs) and all(bitwise_equal(ours[i], theirs[i]) for i in ours)


@pytest.fixture
def slices() -> Iterator[list[tuple[int, int, int]]]:
    """Each slice stepped: (id of the weight, first value, values)."""
    calls: list[tuple[int, int, int]] = []
    own = low_bit_state.slice_stepper

    def recording(optimizer: Any, p: torch.Tensor, group: Any) -> Any:
        step = own(optimizer, p, group)

        def recorded(grad: torch.Tensor, first: int) -> None:
            calls.append((id(p), first, grad.numel()))
            assert p.grad is None
            step(grad, first)

        return recorded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(low_bit_state, "slice_stepper", recording)
        yield calls


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
@pytest.mark.parametrize("state", ["8bit", "4bit", "fp8"])
@pytest.mark.parametrize("level", ["bf16-sr", "bf16-pure", "bf16-kahan", "O1"])
def test_a_slice_at_a_time_is_the_whole_gradients_step_bit_for_bit(
        level: str, state: str, optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model, opt = _prepared(False, monkeypatch, level, state, optimizer)
    whole, whole_opt = _prepared(True, monkeypatch, level, state, optimizer)
    assert _sliced(model) == ["a", "b"] and _sliced(whole) == []  # the head is below 2 slices
    assert all(torch.equal(p, q) for p, q in zip(_train(model, opt), _train(whole, whole_opt), strict=True))
    assert _same_state(opt, whole_opt)


def test_no_whole_gradient_is_alive_and_every_value_is_stepped_once(
        monkeypatch: pytest.MonkeyPatch, slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    model, opt = _prepared(False, monkeypatch)
    _train(model, opt, steps=2)
    for layer in (model.a, model.b):
        mine = [(first, n) for p, first, n in slices if p == id(layer.weight)]
        assert all(n <= SMALL for _, n in mine)  # the recorder checked .grad stayed None
        per_step = math.ceil(layer.weight.numel() / SMALL)
        assert len(mine) == 2 * per_step
        assert [f for f, _ in mine[:per_step]] == list(range(0, layer.weight.numel(), SMALL))
        assert int(opt.state[layer.weight]["step"]) == 2  # counted once a step, not once a slice
    assert mixprec.memory_report(model, opt).gradients == 0


def test_a_ragged_last_slice_and_a_partial_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_gradients, "SLICE", 700)  # 704 = 11 rows of 64 (11 whole blocks of 64 at 4 bits)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 100), nn.GELU(), nn.Linear(100, 10))  # 6400 values: the last slice ragged

    model, opt = _prepared(False, monkeypatch, state="4bit", model=net())
    whole, whole_opt = _prepared(True, monkeypatch, state="4bit", model=net())
    assert sliced_gradients.slice_rows((100, 64), 128) == 10  # whole 128-value blocks: an even number of rows
    assert _sliced(model) == ["0"]
    assert all(torch.equal(p, q) for p, q in zip(_train(model, opt), _train(whole, whole_opt), strict=True))
    assert _same_state(opt, whole_opt)


@pytest.mark.parametrize("level", ["bf16-sr", "bf16-kahan"])
def test_without_the_cpu_kernel_the_eager_step_takes_the_slices(
        level: str, monkeypatch: pytest.MonkeyPatch, slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    from mixprec._src.optim import fused_adam

    monkeypatch.setattr(fused_adam, "NATIVE", False)
    monkeypatch.setattr(fused_adam, "runs", lambda *_: False)  # no compiled graph either: the eager step
    model, opt = _prepared(False, monkeypatch, level)
    whole, whole_opt = _prepared(True, monkeypatch, level)
    assert all(torch.equal(p, q) for p, q in zip(_train(model, opt), _train(whole, whole_opt), strict=True))
    assert _same_state(opt, whole_opt) and slices


def test_input_and_bias_gradients_are_autograds(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _prepared(False, monkeypatch, "bf16-pure")
    x = torch.randn(4, 8, 64, requires_grad=True)  # 3-D: flattened to rows, as linear's backward does
    grads = []
    for sliced in (True, False):
        if not sliced:
            model.a.forward = nn.Linear.forward.__get__(model.a)  # type: ignore[method-assign]
            model.b.forward = nn.Linear.forward.__get__(model.b)  # type: ignore[method-assign]
        before = [p.detach().clone() for p in model.parameters()]
        x.grad = None
        model(x).square().sum().backward()
        grads.append(x.grad.clone())  # type: ignore[union-attr]
        opt.step()  # the small parameters are stepped here
        with torch.no_grad():
            for p, q in zip(model.parameters(), before, strict=True):
                p.copy_(q)
    assert torch.equal(grads[0], grads[1])


def test_transformers_conv1d_and_an_attentions_in_projection_are_sliced(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.pytorch_utils import Conv1D

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
            self.up, self.down = Conv1D(128, 64), Conv1D(64, 128)  # GPT-2's: weights stored (in, out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + self.attn(x, x, x, need_weights=False)[0]
            return h + self.down(F.gelu(self.up(h)))

    model, opt = _prepared(False, monkeypatch, model=Block())
    whole, whole_opt = _prepared(True, monkeypatch, model=Block())
    assert _sliced(model) == ["attn.in_proj", "attn.out_proj", "up", "down"]
    for step in range(3):
        for net, o in ((model, opt), (whole, whole_opt)):
            x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(step))
            net(x).square().mean().backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole.parameters(), strict=True))
    assert _same_state(opt, whole_opt)


def test_a_layer_called_twice_steps_the_sum_of_its_gradients_at_the_last(
        monkeypatch: pytest.MonkeyPatch, slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    model, opt = _prepared(False, monkeypatch, model=_Net(twice=True))
    whole, whole_opt = _prepared(True, monkeypatch, model=_Net(twice=True))
    assert all(torch.equal(p, q) for p, q in zip(_train(model, opt), _train(whole, whole_opt), strict=True))
    assert _same_state(opt, whole_opt)
    assert sum(p == id(model.b.weight) for p, _, _ in slices) == 3 * 16  # stepped once a step, in slices


def test_a_graph_dropped_without_backward_leaves_the_gradient_whole_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model, opt = _prepared(False, monkeypatch)
    whole, whole_opt = _prepared(True, monkeypatch)
    x, _ = _batch(99)
    model(x)  # gradients on, no backward: the sliced layers wait for a backward that never comes
    with pytest.warns(UserWarning, match="stepped whole at optimizer.step"):
        _train(model, opt, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once; and the next step slices again
        mine = _train(model, opt, steps=2, first=1)
    _train(whole, whole_opt, steps=1)
    assert all(torch.equal(p, q) for p, q in zip(mine, _train(whole, whole_opt, steps=2, first=1), strict=True))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool, monkeypatch: pytest.MonkeyPatch,
                                  slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(_Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(super().forward, x, use_reentrant=reentrant)  # type: ignore[no-any-return]

    model, opt = _prepared(False, monkeypatch, model=Checkpointed())
    whole, whole_opt = _prepared(True, monkeypatch, model=Checkpointed())
    x = torch.randn(32, 64, requires_grad=True)  # the reentrant checkpoint needs an input that requires grad
    for net, o in ((model, opt), (whole, whole_opt)):
        F.cross_entropy(net(x), _batch(0)[1]).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole.parameters(), strict=True))
    assert len(slices) == 8 + 16  # stepped in backward, a slice at a time (not left to optimizer.step())


def test_clipping_scales_each_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec._src.step import step_in_backward

    results = []
    for whole in (False, True):
        model, opt = _prepared(whole, monkeypatch, clip_grad_norm=0.1)
        # a previous norm above any this backward reaches: every gradient, sliced or whole, is scaled by 0.1 / 50
        opt.__dict__[step_in_backward.KEY].previous = torch.tensor(50.0)
        results.append((_train(model, opt, steps=1), mixprec.grad_norm(opt)))
    (mine, my_norm), (theirs, their_norm) = results
    assert all(torch.equal(p, q) for p, q in zip(mine, theirs, strict=True))
    assert torch.allclose(my_norm, their_norm, rtol=1e-6)  # the same gradients, summed in slices


def test_compiled_the_gradients_stay_whole(monkeypatch: pytest.MonkeyPatch,
                                           slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    torch._dynamo.reset()
    model, opt = _prepared(False, monkeypatch)
    whole, whole_opt = _prepared(True, monkeypatch)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
    assert counter.frame_count == 1 and not slices  # one graph; the parameters' hooks stepped whole gradients
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _train(whole, whole_opt), strict=True))
    torch._dynamo.reset()


def test_where_it_does_not_apply_the_layer_computes_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _ = _prepared(False, monkeypatch)
    for options in ({"state": "fp32"}, {"level": "O2"}):
        model, _ = _prepared(False, monkeypatch, **options)  # type: ignore[arg-type]
        assert _sliced(model) == []

    tied = _Net()
    tied.b.weight = nn.Parameter(torch.randn(128, 128))
    tied.extra = nn.Linear(128, 128)
    tied.extra.weight = tied.b.weight  # held by two modules: its gradient is whole when both have spoken
    model, _ = _prepared(False, monkeypatch, model=tied)
    assert _sliced(model) == ["a"]
    frozen = _Net()
    frozen.a.weight.requires_grad_(False)
    model, _ = _prepared(False, monkeypatch, model=frozen)
    assert _sliced(model) == ["b"]
    sgd_model = _Net()
    opt = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    mixprec.prepare(sgd_model, opt, "bf16-sr", optimizer_state="8bit", step_in_backward=True)
    assert _sliced(sgd_model) == []


def test_export_gives_the_layers_their_forward_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _prepared(False, monkeypatch)
    _train(model, opt, steps=1)
    mixprec.export_fp32(model, opt)
    assert _sliced(model) == [] and "forward" not in model.a.__dict__
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("state", ["8bit", "4bit"])
def test_memory_plan_counts_a_slice_in_flight(state: str, monkeypatch: pytest.MonkeyPatch,
                                              slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    config = mixprec.PrepareConfig(level="bf16-sr", optimizer_state=state, step_in_backward=True)
    net = _Net()
    plan = mixprec.memory_plan(net, torch.optim.AdamW(net.parameters()), config)
    model, opt = _prepared(False, monkeypatch, state=state)
    _train(model, opt, steps=1)
    small = [p for p in model.parameters() if p.numel() < step_in_backward.SMALL]
    waiting = sum(p.numel() * p.element_size() for p in small)  # held in the bucket: the norm's in fp32
    assert small and waiting > 2 * sum(p.numel() for p in small)
    assert all(p.numel() < step_in_backward.SMALL for p in model.parameters() if p.dim() < 2 or p is model.head.weight)
    # a weight made a slice at a time steps the bucket first: its slices or the bucket's gradients, not both
    assert plan.gradients_in_flight == max(2 * max(n for _, _, n in slices), waiting)  # bf16 slices
    clipped = mixprec.memory_plan(
        net, torch.optim.AdamW(net.parameters()), dataclasses.replace(config, clip_grad_norm=1.0)
    )
    assert clipped.gradients_in_flight == 2 * max(n for _, _, n in slices) + waiting  # the small ones wait for step()
    assert plan.largest_gradient == 2 * model.b.weight.numel()  # stepping after backward: whole
    fp32_state = dataclasses.replace(config, optimizer_state="fp32")
    fp32 = mixprec.memory_plan(net, torch.optim.AdamW(net.parameters()), fp32_state)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fp32.gradients_in_flight == every < step_in_backward.BUCKET  # not sliced: all fit in the bucket


def _gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _lm_step(model: nn.Module, step: int) -> None:
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    logits = model(input_ids=tokens).logits  # the loss outside the model (transformers logs in its own)
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()


def test_a_config_built_gpt2_trains_as_with_whole_gradients(monkeypatch: pytest.MonkeyPatch,
                                                            slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    model, opt = _prepared(False, monkeypatch, model=_gpt2())
    whole, whole_opt = _prepared(True, monkeypatch, model=_gpt2())
    assert _sliced(model) == [f"transformer.h.{i}.{name}" for i in (0, 1)
                              for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    for step in range(3):
        for net, o in ((model, opt), (whole, whole_opt)):
            _lm_step(net, step)
            o.step()
    assert slices and all(torch.equal(p, q) for p, q in zip(model.parameters(), whole.parameters(), strict=True))
    assert _same_state(opt, whole_opt)


def test_a_config_built_gpt2_compiles_whole(monkeypatch: pytest.MonkeyPatch,
                                            slices: list[tuple[int, int, int]]) -> None:  # fmt: skip
    torch._dynamo.reset()
    model, opt = _prepared(False, monkeypatch, model=_gpt2())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for step in range(3):
        _lm_step(compiled, step)
        opt.step()
    assert counter.frame_count == 1 and not slices  # one graph; whole gradients, stepped by the hooks
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()
