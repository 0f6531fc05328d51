"""mixprec.autocast seen from torch and other people's code: C++ composites, checkpointing,
torch's own switches, threads and compile, against torch.autocast bit for bit."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from helpers import bitwise_equal, requires_cuda
from mixprec._src.amp import dispatch as dispatch_module
from mixprec._src.amp import thread_state

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# Every op torch's CPU list lowers, moved to fp32: a region with it must compute what fp32 computes, bit
# for bit, inside C++ composites (LSTM's cells, einsum's bmm) too. Torch's own region differs from fp32
# on every module below but einsum_outer/trace/sum (no lowered op), so the edit is seen to reach them.
_CPU = mixprec.get_policy("cpu")
ALL_FP32 = _CPU.add("fp32", *sorted(_CPU.lower))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's Llama: upcast, normalise in fp32, cast back
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderBlock(nn.Module):
    """A Hugging Face-style decoder block: RMSNorm, rotary embeddings, SDPA, gated MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate, self.up, self.down = nn.Linear(dim, 64), nn.Linear(dim, 64), nn.Linear(64, dim)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # rotary embedding computed in fp32 with autocast off, as Hugging Face does
        with torch.autocast(x.device.type, enabled=False):
            freqs = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _composites() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]]]]:
    def fn_module(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> Any:
        class Wrap(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.p = nn.Parameter(torch.randn(*shapes[0]))

            def forward(self, *xs: torch.Tensor) -> torch.Tensor:
                return fn(self.p, *xs)

        return Wrap

    return {
        "lstm": (lambda: nn.LSTM(8, 16, num_layers=2), lambda: (torch.randn(5, 3, 8),)),
        "gru": (lambda: nn.GRU(8, 16, bidirectional=True), lambda: (torch.randn(5, 3, 8),)),
        "rnn": (lambda: nn.RNN(8, 16), lambda: (torch.randn(5, 3, 8),)),
        "bilinear": (lambda: nn.Bilinear(6, 7, 5), lambda: (torch.randn(4, 6), torch.randn(4, 7))),
        "einsum_bmm": (
            fn_module(lambda p, x: torch.einsum("bij,jk->bik", x, p), (6, 5)),
            lambda: (torch.randn(3, 4, 6),),
        ),
        "einsum_outer": (fn_module(lambda p, x: torch.einsum("i,j->ij", x, p), (5,)), lambda: (torch.randn(4),)),
        "einsum_trace": (fn_module(lambda p, x: torch.einsum("ii,i->i", x, p), (4,)), lambda: (torch.randn(4, 4),)),
        "einsum_sum": (fn_module(lambda p, x: torch.einsum("ij->", x * p), (4, 4)), lambda: (torch.randn(4, 4),)),
        "tensordot": (
            fn_module(lambda p, x: torch.tensordot(x, p, dims=2), (4, 5, 3)),
            lambda: (torch.randn(2, 4, 5),),
        ),
        "tensordot_0": (fn_module(lambda p, x: torch.tensordot(x, p, dims=0), (3,)), lambda: (torch.randn(2),)),
        "pinv": (fn_module(lambda p, x: torch.linalg.pinv(p + x), (5, 4)), lambda: (torch.randn(5, 4),)),
        "cov": (fn_module(lambda p, x: torch.cov(p * x), (3, 8)), lambda: (torch.randn(3, 8),)),
        "corrcoef": (fn_module(lambda p, x: torch.corrcoef(p * x), (3, 8)), lambda: (torch.randn(3, 8),)),
        "transformer": (
            lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), 2),
            lambda: (torch.randn(2, 6, 16),),
        ),
        "decoder_block": (DecoderBlock, lambda: (torch.randn(2, 7, 32),)),
    }


def _fwd_bwd(make: Callable[[], nn.Module], inputs: tuple[torch.Tensor, ...], region: Any) -> Any:
    torch.manual_seed(0)
    module = make()
    xs = tuple(x.clone().requires_grad_() for x in inputs)
    with region:
        out = module(*xs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    return out, [p.grad for p in module.parameters()], [x.grad for x in xs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(_composites()))
def test_composite_modules_fwd_bwd_bitwise(name: str, dtype: torch.dtype) -> None:
    make, inputs = _composites()[name]
    torch.manual_seed(1)
    xs = inputs()
    expected = _outcome(lambda: _fwd_bwd(make, xs, torch.autocast("cpu", dtype=dtype)))
    got = _outcome(lambda: _fwd_bwd(make, xs, mixprec.autocast("cpu", dtype=dtype)))
    assert bitwise_equal(got, expected)  # where torch raises, mixprec raises the same error
    if _raised(expected):
        pytest.xfail(f"torch itself raises here (mixprec raises the same): {expected[1][:120]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(_composites()))
def test_composite_modules_under_an_edit_compute_what_it_says(name: str, dtype: torch.dtype) -> None:
    make, inputs = _composites()[name]
    torch.manual_seed(1)
    xs = inputs()
    fp32 = _fwd_bwd(make, xs, contextlib.nullcontext())
    assert bitwise_equal(_fwd_bwd(make, xs, mixprec.autocast("cpu", dtype=dtype, policy=ALL_FP32)), fp32)
    if not name.startswith(("einsum_outer", "einsum_trace", "einsum_sum")):
        lowered = _outcome(lambda: _fwd_bwd(make, xs, mixprec.autocast("cpu", dtype=dtype)))
        assert _raised(lowered) or not bitwise_equal(lowered, fp32)  # without the edit: another result


def _outcome(run: Callable[[], Any]) -> Any:
    """The result, or where torch itself fails (LSTM on CPUs without bf16/fp16 kernels, pinv), the error."""
    try:
        return run()
    except RuntimeError as error:
        return ("raised", str(error))


def _raised(outcome: Any) -> bool:
    return isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] == "raised"


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformer_inference_fast_path_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 16)
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=dtype):
            expected = model(x)
        with mixprec.autocast("cpu", dtype=dtype):
            got = model(x)
    assert bitwise_equal(got, expected)


# --- torch sees the region --------------------------------------------------------------


def test_torch_sees_the_region() -> None:
    with mixprec.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.float16
        assert not torch.is_autocast_cache_enabled()
        assert mixprec.is_autocast_enabled("cpu") and mixprec.get_autocast_dtype("cpu") is torch.float16
    assert not torch.is_autocast_enabled("cpu")


LOWER_EXP = _CPU.add("lower", "exp")  # exp is fp32 under torch's list; the edit lowers it


@pytest.mark.parametrize("policy", [None, LOWER_EXP], ids=["builtin", "edited"])
def test_torch_autocast_disabled_inside_turns_it_off(policy: Any) -> None:
    a = torch.randn(4, 4)
    with mixprec.autocast("cpu", policy=policy):
        with torch.autocast("cpu", enabled=False):  # off means off, the edit too
            assert torch.mm(a, a).dtype is torch.float32
            assert torch.exp(a).dtype is torch.float32
        assert torch.mm(a, a).dtype is torch.bfloat16
        assert torch.exp(a).dtype is (torch.float32 if policy is None else torch.bfloat16)  # the edit is in force


class _Fp32Function(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


@pytest.mark.parametrize("policy", [None, LOWER_EXP], ids=["builtin", "edited"])
def test_torch_custom_fwd_cast_inputs_inside_region(policy: Any) -> None:
    # custom_fwd(cast_inputs=fp32) runs the function with autocast off, as under torch: its forward and
    # backward are torch's bit for bit; the edit applies again to what follows it.
    a, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    results = []
    for region in (torch.autocast("cpu"), mixprec.autocast("cpu", policy=policy)):
        with region:
            out = _Fp32Function.apply(a.bfloat16(), b)
            after = torch.exp(out)
        out.sum().backward()
        results.append((out, a.grad.clone(), b.grad.clone(), after.dtype))
        a.grad = b.grad = None
    assert results[0][0].dtype is torch.float32
    assert bitwise_equal(results[0][:3], results[1][:3])
    assert results[1][3] is (torch.float32 if policy is None else torch.bfloat16)


# --- activation checkpointing ---------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))


def _train_grads(model: nn.Module, region: Callable[[], Any], ckpt: Callable[..., Any] | None) -> Any:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with region():
        out = ckpt(model, x) if ckpt is not None else model(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out, grads, x.grad


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_with_builtin_policy_is_torchs(reentrant: bool, dtype: torch.dtype) -> None:
    model = _mlp()
    ckpt = functools.partial(checkpoint, use_reentrant=reentrant)
    expected = _train_grads(model, lambda: torch.autocast("cpu", dtype=dtype), ckpt)
    got = _train_grads(model, lambda: mixprec.autocast("cpu", dtype=dtype), ckpt)
    assert bitwise_equal(got, expected)


POLICIES = {
    "edited": mixprec.get_policy("cpu").add("fp32", "linear").add("lower", "gelu"),
    "rules": mixprec.get_policy("cpu").keep_modules(nn.LayerNorm).keep_modules(names="3", dtype="fp16"),
    "both": mixprec.get_policy("cpu").add("fp32", "addmm").keep_modules(nn.GELU),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_checkpoint_with_edited_policy_equals_no_checkpoint(name: str) -> None:
    model, policy = _mlp(), POLICIES[name]
    expected = _train_grads(model, lambda: mixprec.autocast("cpu", policy=policy), None)
    ckpt = functools.partial(checkpoint, use_reentrant=False, context_fn=mixprec.checkpoint_context)
    got = _train_grads(model, lambda: mixprec.autocast("cpu", policy=policy), ckpt)
    assert bitwise_equal(got, expected)
    assert dispatch_module.registered() == []


def test_checkpoint_context_composes_with_selective_checkpointing() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    model, policy = _mlp(), POLICIES["both"]
    expected = _train_grads(model, lambda: mixprec.autocast("cpu", policy=policy), None)
    selective = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    context_fn = functools.partial(mixprec.checkpoint_context, inner=selective)
    ckpt = functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn)
    assert bitwise_equal(_train_grads(model, lambda: mixprec.autocast("cpu", policy=policy), ckpt), expected)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_that_would_lose_the_policy_raises(name: str, reentrant: bool) -> None:
    model, policy = _mlp(), POLICIES[name]
    ckpt = functools.partial(checkpoint, use_reentrant=reentrant)
    with pytest.raises(mixprec.CheckpointReplayError, match=r"context_fn=mixprec\.checkpoint_context") as raised:
        _train_grads(model, lambda: mixprec.autocast("cpu", policy=policy), ckpt)
    assert isinstance(raised.value, RuntimeError)  # as raised before the error had its own type


class _SwitchModel(nn.Module):
    """A model with its own checkpointing switch, as Hugging Face models have."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DecoderBlock() for _ in range(2))
        self.gradient_checkpointing = False
        self._checkpoint: Callable[..., Any] = checkpoint

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any]) -> None:
        self._checkpoint = functools.partial(checkpoint, **gradient_checkpointing_kwargs)
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self._checkpoint(block, x) if self.gradient_checkpointing else block(x)
        return x


@pytest.mark.parametrize("policy", [None, POLICIES["both"]], ids=["builtin", "edited"])
def test_models_own_checkpointing_switch(policy: Any) -> None:
    x = torch.randn(2, 5, 32)
    results = []
    for enable in (False, True):
        model = _SwitchModel()
        if enable:
            model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": mixprec.checkpoint_context})
        with mixprec.autocast("cpu", policy=policy):
            out = model(x)
        out.float().sum().backward()
        results.append((out, [p.grad for p in model.parameters()]))
    assert bitwise_equal(results[0], results[1])


# --- isolation: threads, later regions, torch.autocast ------------------------------------


def _step(region: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Softplus(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with region:
        out = model(x).exp().sum()
    out.float().backward()
    return out, [p.grad for p in model.parameters()]


def test_edited_region_in_another_thread_changes_nothing_here() -> None:
    edited = mixprec.get_policy("cpu").add("fp32", "linear", "addmm").add("lower", "exp", "softplus")
    expected_torch = _step(torch.autocast("cpu"))
    opened, release = threading.Event(), threading.Event()

    def other() -> None:
        with mixprec.autocast("cpu", policy=edited):
            assert _step(torch.autocast("cpu"))[0].dtype is torch.bfloat16  # exp in lower there
            opened.set()
            release.wait(30)
        thread_state._tls.__dict__.clear()

    worker = threading.Thread(target=other)
    worker.start()
    try:
        assert opened.wait(30)
        assert "aten::exp@cpu" in dispatch_module.registered()
        assert bitwise_equal(_step(torch.autocast("cpu")), expected_torch)
        assert bitwise_equal(_step(mixprec.autocast("cpu")), expected_torch)
    finally:
        release.set()
        worker.join()
    assert dispatch_module.registered() == []
    assert bitwise_equal(_step(torch.autocast("cpu")), expected_torch)  # and after it closed


# --- compile ------------------------------------------------------------------------------


def test_policy_change_between_compiled_calls_recompiles() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(4, 16)
    policies = [POLICIES["both"], mixprec.get_policy("cpu"), POLICIES["rules"], POLICIES["both"]]
    current = {"policy": policies[0]}

    def step(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=current["policy"]):
            return model(x)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    got = []
    for policy in policies:
        current["policy"] = policy
        got.append(compiled(x))
    assert counter.frame_count == 3  # one graph per distinct policy, the repeat reused
    for policy, out in zip(policies, got, strict=True):
        current["policy"] = policy
        assert bitwise_equal(out, step(x))


def test_compiled_code_in_an_eager_edited_region_refuses_instead_of_going_stale() -> None:
    torch._dynamo.reset()
    model = torch.compile(_mlp(), backend="aot_eager")
    with mixprec.autocast("cpu", policy=POLICIES["edited"]), pytest.raises(Exception, match="inside the compiled"):
        model(torch.randn(4, 16))


EXP_FP32 = _CPU.add("fp32", "exp")  # reaches the torch.exp after the break


@pytest.mark.parametrize("policy", [None, EXP_FP32, POLICIES["rules"]], ids=["builtin", "edited", "rules"])
def test_graph_break_inside_a_compiled_region_falls_back_to_eager(policy: Any) -> None:
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(4, 16)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with mixprec.autocast("cpu", policy=policy):
            h = model(x)
            torch._dynamo.graph_break()
            return h, torch.exp(h), torch.mm(h, h.t())

    expected = step(x)
    # the policy in force after the break: exp edited to fp32; the last Linear kept in fp16 by the rules
    want = {None: torch.bfloat16, EXP_FP32: torch.float32, POLICIES["rules"]: torch.float16}[policy]
    assert expected[1].dtype is want
    for backend in ("eager", "aot_eager"):
        got = torch.compile(step, backend=backend)(x)
        assert bitwise_equal(got, expected)
        assert not torch.is_autocast_enabled("cpu") and not dispatch_module.state().regions
        assert dispatch_module.registered() == []


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class _CheckpointedNet(nn.Module):
    def __init__(self, checkpoint_forward: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.checkpoint_forward = checkpoint_forward

    def forward(self, x: torch.Tensor, ckpt: bool = True) -> torch.Tensor:
        for block in self.blocks:
            fn = block.forward if self.checkpoint_forward else block  # Hugging Face checkpoints `forward`
            x = checkpoint(fn, x, use_reentrant=False, context_fn=mixprec.checkpoint_context) if ckpt else fn(x)
        return x


@pytest.mark.parametrize("checkpoint_forward", [True, False], ids=["forward", "module"])
@pytest.mark.parametrize("pattern", ["blocks.1.mlp", "blocks.1", "*.mlp"])
def test_rules_by_name_reach_modules_in_the_recompute(checkpoint_forward: bool, pattern: str) -> None:
    policy = mixprec.get_policy("cpu").keep_modules(names=pattern)
    results = []
    for ckpt in (False, True):
        net, x = _CheckpointedNet(checkpoint_forward), torch.randn(2, 8, requires_grad=True)
        with mixprec.autocast("cpu", policy=policy):
            y = net(x, ckpt=ckpt)
        y.float().sum().backward()
        results.append((y, x.grad, [p.grad for p in net.parameters()]))
    # A module whose forward is called directly runs no hooks: a rule naming it has no boundary
    # to act on (its children still match), with or without checkpointing alike.
    applies = not (checkpoint_forward and pattern == "blocks.1")
    assert results[0][0].dtype is (torch.float32 if applies else torch.bfloat16)
    assert bitwise_equal(results[0], results[1])


def test_qualified_names_do_not_depend_on_which_root_ran_first() -> None:
    net, x = nn.Sequential(nn.Sequential(nn.Linear(4, 4))), torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=mixprec.get_policy("cpu").keep_modules(names="0.0")):
        assert net[0](x).dtype is torch.bfloat16  # called as a root, the Linear is "0"
        assert net(x).dtype is torch.float32  # from net it is "0.0"


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_region_is_torchs_and_edits_apply(dtype: torch.dtype) -> None:
    model = DecoderBlock().cuda()
    x = torch.randn(2, 7, 32, device="cuda")
    expected = _fwd_bwd(lambda: DecoderBlock().cuda(), (x,), torch.autocast("cuda", dtype=dtype))
    got = _fwd_bwd(lambda: DecoderBlock().cuda(), (x,), mixprec.autocast("cuda", dtype=dtype))
    assert bitwise_equal(got, expected)
    edited = mixprec.get_policy("cuda").add("fp32", "scaled_dot_product_attention").remove("exp")
    with mixprec.autocast("cuda", dtype=dtype, policy=edited):
        q = torch.randn(1, 2, 4, 8, device="cuda")
        assert F.scaled_dot_product_attention(q, q, q).dtype is torch.float32
        assert torch.exp(q).dtype is torch.float32  # removed from fp32: runs in its input dtype
        assert torch.exp(q.to(dtype)).dtype is dtype
        assert model(x).dtype is torch.float32
