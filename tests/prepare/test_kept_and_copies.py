"""How prepare keeps norms in fp32 and routes O2's gradients, on the paths that cost no Python call.

torch's norm layers get a forward of their own (fp32 inputs, the same op) instead of the two hooks other
kept modules get; O2's copies reach the masters' gradients through a view (C++ backward) instead of an
autograd Function. Both must give the numbers of the paths they replace, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal
from mixprec._src.prepare import levels, o2_copies


class _LayerNorm(nn.LayerNorm):  # a subclass: kept by the hooks
    pass


class _GroupNorm(nn.GroupNorm):
    pass


class _RMSNorm(nn.RMSNorm):
    pass


NORMS = {
    "layer": (lambda: nn.LayerNorm(16), lambda: _LayerNorm(16)),
    "group": (lambda: nn.GroupNorm(4, 16), lambda: _GroupNorm(4, 16)),
    "rms": (lambda: nn.RMSNorm(16), lambda: _RMSNorm(16)),
}


def _net(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), norm, nn.Linear(16, 4))
    with torch.no_grad():  # a norm's weight that is not all ones, so a wrong weight shows
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    return net


def _run(net: nn.Module, level: str) -> tuple[list[torch.Tensor], nn.Module]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = mixprec.prepare(net, opt, level=level)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = net(x)
    out.square().sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in net.parameters())], net


@pytest.mark.parametrize("level", ["O1", "O2", "bf16-pure"])
@pytest.mark.parametrize("kind", list(NORMS))
def test_a_torch_norm_kept_by_its_own_forward_computes_as_the_hooks_do(kind: str, level: str) -> None:
    own, hooked = NORMS[kind]
    ours, net = _run(_net(own()), level)
    theirs, other = _run(_net(hooked()), level)
    assert "forward" in net[1].__dict__ and not net[1]._forward_pre_hooks  # the path under test
    assert "forward" not in other[1].__dict__ and other[1]._forward_pre_hooks
    assert bitwise_equal(ours, theirs)
    seen = []
    net[1].register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, out.dtype)))
    net(torch.randn(2, 16))
    assert seen == [(torch.bfloat16, torch.float32)]  # the linear's bf16 output in, fp32 out


def test_a_policy_that_lowers_the_norms_op_keeps_it_with_hooks() -> None:
    # inside a kept module autocast is off: only the hooks do that; the own forward would run the op in bf16
    policy = mixprec.builtin_policy("cpu").add("lower", "layer_norm")
    net = _net(nn.LayerNorm(16))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O1", policy=policy)
    assert "forward" not in net[1].__dict__
    seen = []
    net[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    net(torch.randn(2, 16))
    assert seen == [torch.float32]


def test_a_kept_norm_with_a_forward_of_its_own_is_undone_by_export() -> None:
    net = _net(nn.LayerNorm(16))
    net, opt = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    mixprec.export_fp32(net, opt)
    assert not any("forward" in m.__dict__ for m in net.modules())


def _probed_encoder(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.TransformerEncoder, list[int]]:
    """A two-layer encoder, and the calls of torch's fused encoder kernel (one entry a call) from now on."""
    fused = torch._transformer_encoder_layer_fwd
    calls: list[int] = []
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or fused(*a, **k))
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), calls


def test_eval_keeps_the_encoders_fused_path_off_where_a_norm_has_its_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's fused encoder path would run the norms in the kernel's precision, skipping their forward
    enc, calls = _probed_encoder(monkeypatch)
    enc.eval()
    with torch.no_grad():
        enc(torch.randn(2, 5, 16))
    assert calls  # the probe sees the fused path where nothing stops it
    calls.clear()
    enc, _ = mixprec.prepare(enc, torch.optim.SGD(enc.parameters(), lr=0.1), level="O1")
    assert "forward" in enc.layers[0].norm1.__dict__
    assert not enc.layers[0]._forward_pre_hooks  # on its attention's uncalled out_proj: no cost when training
    with torch.no_grad():
        enc(torch.randn(2, 5, 16))
    assert not calls


def test_eval_keeps_the_encoders_fused_path_off_where_o2_swaps_its_layers_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # with nothing kept (bf16 inputs: the norms compute in bf16), only O2's swaps tell torch the layers must be
    # called: the fused kernel would read the fp32 masters
    enc, calls = _probed_encoder(monkeypatch)
    enc, _ = mixprec.prepare(enc, torch.optim.SGD(enc.parameters(), lr=0.1), level="O2", keep_types=())
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    enc(x)
    with torch.no_grad():
        enc.eval()(x)
    assert not calls


# ----- O2: the gradient through the copy -------------------------------------------------------


def _o2_grads(route: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    master = torch.randn(6, 5, requires_grad=True)
    held = master.detach().to(torch.bfloat16)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    weight = route(master, held)  # type: ignore[operator]
    assert weight.dtype is torch.bfloat16 and torch.equal(weight, held)
    (F.linear(x, weight).float().square().sum() + F.linear(x, weight).float().sum()).backward()  # used twice
    return [master.grad]


def test_o2_copies_view_route_gives_the_functions_gradient_in_cxx() -> None:
    assert bitwise_equal(_o2_grads(o2_copies._from_copy), _o2_grads(o2_copies._FromCopy.apply))
    master = torch.randn(4, 4, requires_grad=True)
    weight = o2_copies._from_copy(master, master.detach().to(torch.bfloat16))
    assert type(weight.grad_fn).__name__ == "AliasBackward0"  # no Python call in backward
    assert master.grad is None and _o2_grads(o2_copies._from_copy)[0].dtype is torch.float32


def test_o2_masters_own_hooks_fire_during_backward() -> None:
    # what DDP's reducer and a step in backward rely on: each master's gradient is accumulated by autograd
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    fired: list[torch.dtype] = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.dtype))
    net(torch.randn(3, 8)).sum().backward()
    assert fired == [torch.float32] * 4


def test_o2_a_master_written_between_forward_and_backward_is_reported() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    out = net(torch.randn(3, 8)).sum()
    with torch.no_grad():
        net[2].weight.add_(1.0)  # what the backward would read is no longer what the forward computed with
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


class _UsesItsWeightTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight).relu(), self.weight)


def test_o2_a_module_using_its_weight_twice_sums_the_uses_in_the_copy_dtype() -> None:
    torch.manual_seed(0)
    net, x = _UsesItsWeightTwice(), torch.randn(64, 16)
    master = net.weight.detach().clone()

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().sum()

    copies = [master.to(torch.bfloat16).requires_grad_() for _ in range(2)]  # the uses, widened one by one
    loss(F.linear(F.linear(x.bfloat16(), copies[0]).relu(), copies[1])).backward()
    summed_wide = copies[0].grad.float() + copies[1].grad.float()
    held = master.to(torch.bfloat16).requires_grad_()  # what autocast's cached cast gives: summed in bf16
    loss(F.linear(F.linear(x.bfloat16(), held).relu(), held)).backward()
    assert not torch.equal(held.grad.float(), summed_wide)  # the two ways differ on these values
    net, opt = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    loss(net(x)).backward()
    assert torch.equal(net.weight.grad, held.grad.float())
    for _ in range(2):  # after a step too: each forward's uses summed in bf16 again
        opt.step()
        opt.zero_grad()
        held = net.weight.detach().to(torch.bfloat16).requires_grad_()
        loss(F.linear(F.linear(x.bfloat16(), held).relu(), held)).backward()
        loss(net(x)).backward()
        assert torch.equal(net.weight.grad, held.grad.float())


def test_o2_a_torch_layer_reaches_its_master_through_one_view_and_its_hooks_see_the_copy() -> None:
    net = nn.Sequential(nn.Linear(8, 8), _UsesItsWeightTwice())
    net[1].weight = nn.Parameter(torch.randn(8, 8))
    net, opt = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    seen: list[torch.Tensor] = []
    for layer in net:  # hooks registered after prepare, as a user's or a profiler's are
        layer.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
        layer.register_forward_hook(lambda m, args, out: seen.append(m.weight))
    for _ in range(2):  # and after torch's step, which writes the masters: a view made anew (test below)
        seen.clear()
        loss = net(torch.randn(2, 8)).sum()
        assert [w.dtype for w in seen] == [torch.bfloat16] * 4
        linear, twice = seen[0].grad_fn, seen[2].grad_fn
        assert type(linear).__name__ == "AliasBackward0"  # one alias: straight to the master's accumulator
        assert linear.next_functions[0][0].variable is net[0].weight
        inner = twice.next_functions[0][0]  # two: the uses summed in bf16 by the outer one
        assert type(inner).__name__ == "AliasBackward0" and inner.next_functions[0][0].variable is net[1].weight
        loss.backward()
        assert net[0].weight.grad.dtype is net[1].weight.grad.dtype is torch.float32
        opt.step()


class _Forget(dict):  # type: ignore[type-arg]
    """O2's kept views, never kept: every forward makes its own (the path before views were kept)."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def _o2_training(forget: bool, fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.ReLU(), _UsesItsWeightTwice(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    net, opt = mixprec.prepare(net, opt, level="O2")
    if forget:
        levels.prepared_state(net).copies.aliases = _Forget()  # type: ignore[union-attr]
    calls: list[int] = []

    def hook_the_weight(module: nn.Module, args: object) -> None:  # a user's hook on the weight the forward uses
        module.weight.register_hook(lambda g: calls.append(1))

    net[1].register_forward_pre_hook(hook_the_weight)
    x = torch.randint(0, 32, (4, 8))
    out: list[torch.Tensor] = []
    for step in range(4):
        for _ in range(1 + step % 2):  # two forwards (then three with the second) before one backward
            loss = sum(net(x[:, i : i + 4]).float().square().sum() for i in range(1 + step // 2))
            loss.backward()  # type: ignore[union-attr]
        out += [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
        if step == 1:
            with torch.no_grad():  # a master written in place: its version moves
                net[4].weight.mul_(0.5)
    assert len(calls) == sum((1 + s % 2) * (1 + s // 2) for s in range(4))  # the user's hook once a use
    return out + [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["torch-step", "fused-own-step"])
def test_o2_views_kept_across_forwards_give_each_forwards_gradients(fused: bool) -> None:
    # a torch layer's view of its master is made once and kept until the master is written (torch's for-loop step
    # writes it, the own fused step does not move its version): the same gradients, several forwards to a backward
    assert bitwise_equal(_o2_training(False, fused), _o2_training(True, fused))


def test_o2_a_torch_layers_view_is_kept_until_its_master_or_its_copy_changes() -> None:
    net = nn.Sequential(nn.Linear(8, 8, bias=False))
    net, opt = mixprec.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True), level="O2")
    seen: list[torch.Tensor] = []
    net[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    for _ in range(3):
        net(torch.randn(2, 8)).sum().backward()
        opt.step()
    with torch.no_grad():
        net[0].weight.add_(1.0)  # its version moves
    net(torch.randn(2, 8)).sum().backward()
    assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[2]
    assert type(seen[3].grad_fn).__name__ == "AliasBackward0" and net[0].weight.grad.dtype is torch.float32
    net[0].weight.data = torch.randn(4, 8)  # a master stored anew, its version where it was: a new copy
    assert net(torch.randn(2, 8)).shape == (2, 4) and seen[4] is not seen[3]


def test_o2_a_sparse_embedding_takes_the_function_route() -> None:
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    net, _ = mixprec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2")
    net(torch.tensor([[1, 2, 3]])).sum().backward()
    assert net[0].weight.grad.is_sparse and net[0].weight.grad.dtype is torch.float32


# ----- norms of libraries mixprec does not import ------------------------------------------------


class LlamaRMSNorm(nn.Module):  # Hugging Face's, as written there
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(size)), eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class T5LayerNorm(LlamaRMSNorm):
    pass


class GemmaRMSNorm(LlamaRMSNorm):  # Hugging Face's: its output in its input's dtype
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).type_as(hidden)


class RmsNorm2d(LlamaRMSNorm):  # timm's
    pass


class MambaRMSNormGated(LlamaRMSNorm):
    pass


class FusedLayerNorm(nn.Module):  # apex's
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class AdaLayerNorm(nn.Module):  # a modulation block named like a norm, with a projection inside
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 8), nn.LayerNorm(4, elementwise_affine=False)


class Normalizer(nn.Module):
    pass


@pytest.mark.parametrize(("cls", "norm"), [(LlamaRMSNorm, True), (T5LayerNorm, True), (RmsNorm2d, True),
                                           (MambaRMSNormGated, True), (FusedLayerNorm, True), (AdaLayerNorm, False),
                                           (Normalizer, False), (nn.Linear, False)])  # fmt: skip
def test_norms_of_other_libraries_are_recognised_by_class_name(cls: type[nn.Module], norm: bool) -> None:
    from mixprec._src.policy.rules import named_like_a_norm

    module = cls(4) if cls in (LlamaRMSNorm, T5LayerNorm, RmsNorm2d, MambaRMSNormGated) else (
        nn.Linear(4, 4) if cls is nn.Linear else cls())  # fmt: skip
    assert named_like_a_norm(module) is norm


@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-pure"])
def test_a_norm_of_another_library_is_kept_in_fp32_by_default(level: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), LlamaRMSNorm(16), nn.Linear(16, 16), nn.Linear(16, 4))
    net, opt = mixprec.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), level=level,
                               fp8=mixprec.Fp8Config(convert_head=True))  # fmt: skip
    assert net[1].weight.dtype is torch.float32 and net[1]._forward_pre_hooks  # kept, by the hooks
    assert all(p.dtype is (torch.bfloat16 if level != "O2" else torch.float32) for p in net[3].parameters())
    seen = []
    net[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    F.mse_loss(net(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    opt.step()
    assert seen == [torch.float32] and net[1].weight.grad.dtype is torch.float32
    layers = mixprec.fp8_layers(net)
    assert layers is not None and layers.kept == [("1", "LlamaRMSNorm")]
    assert "kept in fp32: 1 module(s): LlamaRMSNorm x1" in str(layers)


def _hf(name: str) -> tuple[nn.Module, str, int]:
    """A config-built model (no download), its norm class, and how many it has."""
    transformers = pytest.importorskip("transformers")
    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "t5":
        config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       decoder_start_token_id=0, dropout_rate=0.0)  # fmt: skip
        return transformers.T5ForConditionalGeneration(config), "T5LayerNorm", 2 * 2 + 3 * 2 + 2
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm"),
               "mistral": ("MistralConfig", "MistralForCausalLM", "MistralRMSNorm"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2RMSNorm")}  # fmt: skip
    config_class, model_class, norm = classes[name]
    config = getattr(transformers, config_class)(**size, num_key_value_heads=2, max_position_embeddings=16)
    return getattr(transformers, model_class)(config), norm, 2 * 2 + 1


@pytest.mark.parametrize("level", ["O2", "bf16-sr", "bf16-kahan"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "t5"])
def test_a_config_built_models_norms_are_kept_in_fp32(name: str, level: str) -> None:
    torch.manual_seed(0)
    model, norm, count = _hf(name)
    model, opt = mixprec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level=level)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__ == norm}
    assert len(norms) == count
    kept = {id(p) for m in norms.values() for p in m.parameters()}
    low = torch.float32 if level == "O2" else torch.bfloat16
    assert all(p.dtype is (torch.float32 if id(p) in kept else low) for p in model.parameters())
    tokens = torch.randint(0, 64, (2, 8))
    extra = {"decoder_input_ids": tokens} if name == "t5" else {}
    model(tokens, labels=tokens, **extra).loss.backward()
    opt.step()
    for m in norms.values():  # weights, gradients and state in fp32
        for p in m.parameters():
            assert p.dtype is p.grad.dtype is torch.float32
            assert all(v.dtype is torch.float32 for k, v in opt.state[p].items() if k != "step" and v.dim())


def test_a_policy_keeping_norms_recognises_another_librarys_under_fullgraph_compile() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), GemmaRMSNorm(16))  # kept: fp32 in, fp32 out; else bf16 out
    policy = mixprec.get_policy("cpu").keep_modules(mixprec.NORM_TYPES)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
            return net(x)  # type: ignore[no-any-return]

    x = torch.randn(2, 16)
    eager = forward(x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forward, fullgraph=True, backend=counter)
    for _ in range(2):
        got = compiled(x)
        assert got.dtype is torch.float32 and bitwise_equal(got, eager)
    assert counter.frame_count == 1
    with mixprec.autocast("cpu", policy=policy):  # an eager region with rules removes the global module hooks
        pass
