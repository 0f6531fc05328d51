"""O2's copies put in place once for the prepared model's whole call, and each layer's swap kept between calls.

In an eager forward with gradients, the prepared model's call puts every torch layer's copies in place at once and
lifts the layers' own calls; a layer's swap keeps what it put and puts it again while its masters are as they were.
Each shortcut must give what the per-layer swap gave (the tests of test_kept_and_copies.py hold it to those numbers)
and fall back where it no longer holds: a master frozen or thawed, replaced, written, stored anew.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec._src.prepare import levels, o2_copies


class _ReadsOfMasters(TorchDispatchMode):
    """Records the ATen ops that read the data of one of ``masters`` (by address)."""

    def __init__(self, masters: list[torch.Tensor]) -> None:
        super().__init__()
        self.addresses = {m.data_ptr() for m in masters}
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        flat += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
        if any(t.dtype is torch.float32 and t.data_ptr() in self.addresses for t in flat):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _encoder(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    net = nn.Sequential(nn.Embedding(32, 16), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)
    return mixprec.prepare(net, opt, level="O2")


@pytest.mark.parametrize("fused", [False, True], ids=["torch-step", "fused-own-step"])
def test_o2_forward_reads_no_master_after_the_first_after_a_step(fused: bool) -> None:
    # the weights are cast once a step (the first forward after it, or the step itself), never at a use: not the
    # attention's out_proj either (its attention reads its weight without calling it)
    net, opt = _encoder(fused)
    x = torch.randint(0, 32, (2, 6))
    net(x).float().sum().backward()
    opt.step()
    net(x)  # the copies refreshed
    attention = net[1].layers[0].self_attn
    masters = [p for m in net.modules() if not isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)]
    for run in (
        lambda: net(x),  # the whole model, with gradients
        lambda: torch.no_grad()(net)(x),  # each layer's own call
        lambda: attention(*[torch.randn(2, 6, 16, dtype=torch.bfloat16)] * 3),  # the attention called alone
    ):
        with _ReadsOfMasters(masters) as mode:
            run()
        assert mode.reads == []


class _ReadsAChildsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.proj.weight)
        return F.linear(self.proj(x), self.proj.weight)  # the child's weight used by the parent (tied)


def test_o2_a_torch_layers_weight_read_by_its_parent_is_its_copy_with_gradients() -> None:
    torch.manual_seed(0)
    net = _ReadsAChildsWeight()
    net, opt = mixprec.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True), level="O2")
    x = torch.randn(3, 8)
    for _ in range(2):
        net(x).float().square().sum().backward()
        opt.step()
    seen = net.seen[-1]
    assert seen.dtype is torch.bfloat16 and seen is net.seen[-2]  # the kept view, the same both steps
    assert seen.grad_fn.next_functions[0][0].variable is net.proj.weight
    assert net.proj.weight.dtype is torch.float32 and type(net.proj.weight) is nn.Parameter  # outside: the master
    with torch.no_grad():
        net(x)  # without gradients each layer swaps in its own call: outside it, the master
    assert net.seen[-1] is net.proj.weight


class _ReadsAChildsDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # as Hugging Face's T5 reads its projection's dtype
        return self.proj(x).to(self.proj.weight.dtype) * torch.finfo(self.proj.weight.dtype).eps


def test_o2_compiled_a_parent_reads_what_the_eager_forward_reads() -> None:
    torch.manual_seed(0)
    net = _ReadsAChildsDtype()
    net, _ = mixprec.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True), level="O2")
    x = torch.randn(3, 8)
    eager = net(x)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)
    assert eager.dtype is torch.float32 and torch.equal(eager, (net.proj(x.bfloat16()) * 2**-7).float())
    with torch.no_grad():  # without gradients, in its own call alone: fp32 outside it, eager and compiled
        plain = net(x)
        assert torch.equal(compiled(x), plain) and not torch.equal(plain, eager)


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.proj(x)
        raise ValueError("a forward that fails")


def test_o2_the_layers_get_their_calls_and_masters_back_after_the_models_call_even_one_that_raises() -> None:
    net = nn.Sequential(nn.Linear(4, 4), _Fails())
    masters = [net[0].weight, net[1].proj.weight]
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    calls = [net[0].__dict__["_call_impl"], net[1].proj.__dict__["_call_impl"]]
    for _ in range(2):
        with pytest.raises(ValueError, match="a forward that fails"):
            net(torch.randn(2, 4))
        assert [net[0].__dict__.get("_call_impl"), net[1].proj.__dict__.get("_call_impl")] == calls
        assert net[0].weight is masters[0] and net[1].proj.weight is masters[1]
    assert levels.prepared_state(net).copies.lifted is None  # type: ignore[union-attr]
    net[1] = nn.Identity()
    net(torch.randn(2, 4)).sum().backward()  # the next call swaps again
    assert net[0].weight.grad is not None


def test_o2_a_layer_thawed_after_a_forward_gets_its_gradient_and_one_frozen_none() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].weight.requires_grad_(False)
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    x = torch.randn(3, 4)
    net(x).sum().backward()
    assert net[0].weight.grad is None and net[1].weight.grad is not None
    net[0].weight.requires_grad_(True)  # what the kept swap put (the copy, no history) no longer holds
    net[1].weight.requires_grad_(False)
    net[1].weight.grad = None
    net(x).sum().backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.dtype is torch.float32
    assert net[1].weight.grad is None


def test_o2_a_parameter_replaced_after_a_forward_raises_at_the_next() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    net(torch.randn(3, 4)).sum().backward()  # each layer's swap kept
    net[1].weight = nn.Parameter(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"replaced after mixprec.prepare .*no longer steps it"):
        net(torch.randn(3, 4))
    assert net[0].__dict__.get("_call_impl") is not None  # the layers lifted before it got their calls back


def test_o2_a_swap_keeps_nothing_with_history_in_a_pickle() -> None:
    net = nn.Sequential(nn.Linear(4, 4))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    net(torch.randn(2, 4)).sum().backward()
    swap = net[0].__dict__["_call_impl"].swap
    assert isinstance(swap, o2_copies._Swap) and swap.kept is not None
    twin = copy.deepcopy(net)  # views with history cannot be deep-copied: the copy's swap keeps nothing yet
    assert twin[0].__dict__["_call_impl"].swap.kept is None
    twin(torch.randn(2, 4)).sum().backward()
    assert twin[0].weight.grad is not None and twin[0].weight is not net[0].weight


@pytest.mark.parametrize("forwards_before", [0, 1, 2], ids=["none", "one", "two"])
def test_o2_a_master_stored_anew_through_data_is_copied_again(forwards_before: int) -> None:
    # p.data = t keeps p's version counter: its data's new address is what tells the copy is behind
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    net, opt = mixprec.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True), level="O2")
    x = torch.randn(3, 8)
    for _ in range(forwards_before):
        net(x).float().sum().backward()
        opt.step()
    new = torch.randn(8, 8)
    net[0].weight.data = new.clone()
    expected = F.linear(
        F.linear(x.bfloat16(), new.bfloat16(), net[0].bias.bfloat16()),
        *(p.bfloat16() for p in (net[1].weight.detach(), net[1].bias.detach())),
    )
    assert torch.equal(net(x), expected.float())
    with torch.no_grad():
        assert torch.equal(net(x), expected.float())


def test_o2_a_step_that_moves_no_version_and_writes_no_copy_is_seen_by_the_next_forward() -> None:
    # torch's own fused kernel (amsgrad is left to it) writes the masters in place without moving their versions:
    # each layer's kept swap still holds, and the copies are refreshed before it is put again
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True, amsgrad=True)
    net, opt = mixprec.prepare(net, opt, level="O2")
    x = torch.randn(3, 8)
    for _ in range(3):
        versions = [p._version for p in net.parameters()]
        out = net(x)
        expected = F.linear(
            F.linear(x.bfloat16(), *(p.detach().bfloat16() for p in net[0].parameters())),
            *(p.detach().bfloat16() for p in net[1].parameters()),
        )
        assert torch.equal(out, expected.float())
        out.float().sum().backward()
        opt.step()
        opt.zero_grad()
        assert [p._version for p in net.parameters()] == versions  # the kept swaps hold across the step
