"""GEMM layers wherever a model keeps them: kinds, transformers' Conv1D, MultiheadAttention's projections,
patch convolutions, torch's fused inference path, and the reach report."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from helpers import bitwise_equal
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.gemms import attention, kinds, sites

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _torchao_convert(model: nn.Module, recipe: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float8 = pytest.importorskip("torchao.float8")
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=lambda m, n: True)  # fmt: skip
    return model


# --- kinds ---------------------------------------------------------------------------------------------------


class _OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_each_module_has_its_kind_and_a_subclass_with_its_own_forward_is_not_a_layer() -> None:
    sharded_conv1d = type("FSDPConv1D", (Conv1D,), {})  # what fully_shard makes of a unit's class
    cases = {
        nn.Linear(4, 4): kinds.LINEAR,
        nn.MultiheadAttention(8, 2).out_proj: kinds.LINEAR,  # NonDynamicallyQuantizableLinear keeps the forward
        Conv1D(8, 4): kinds.CONV1D,
        sharded_conv1d(8, 4): kinds.CONV1D,
        nn.Conv2d(3, 8, 4, 4): kinds.PATCH,
        nn.Conv1d(3, 8, 1): kinds.PATCH,
        nn.Conv2d(3, 8, 3, padding=1): kinds.CONVOLUTION,
        nn.Conv2d(4, 8, 2, 2, groups=2): kinds.CONVOLUTION,
        _OwnForward(4, 4): None,
        nn.LayerNorm(4): None,
    }
    assert {type(m).__name__ + str(i): kinds.kind_of(m) for i, m in enumerate(cases)} == {
        type(m).__name__ + str(i): k for i, (m, k) in enumerate(cases.items())}  # fmt: skip
    assert "_OwnForward overrides Linear's forward" in (kinds.not_a_layer(_OwnForward(4, 4)) or "")
    assert kinds.not_a_layer(nn.LayerNorm(4)) is None
    assert kinds.features(Conv1D(24, 8)) == (8, 24) and kinds.features(nn.Conv2d(3, 32, 4, 4)) == (48, 32)


# --- transformers' Conv1D ------------------------------------------------------------------------------------


def _conv1d_and_linear(dtype: torch.dtype) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(64, 32), nn.GELU(), Conv1D(32, 64)).to(dtype)
    linear = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype)
    with torch.no_grad():
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            lin.weight.copy_(c.weight.t())
            lin.bias.copy_(c.bias)
    return conv, linear


def _fwd_bwd(model: nn.Module, x: torch.Tensor, region: bool = True) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
        out = model(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad  # type: ignore[return-value]


@pytest.mark.usefixtures("aten_fp8_gemm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_conv1d_in_fp8_is_bitwise_torchaos_float8_linear_on_the_transposed_weight(
    recipe: str, dtype: torch.dtype
) -> None:
    conv, linear = _conv1d_and_linear(dtype)
    fp8_conversion.convert(conv, mixprec.Fp8Config(recipe, convert_head=True), set())
    _torchao_convert(linear, recipe)
    x = torch.randn(2, 24, 32, dtype=dtype)  # 48 tokens
    assert bitwise_equal(_fwd_bwd(conv, x, region=False), _fwd_bwd(linear, x, region=False))
    for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
        assert c.weight.grad is not None and torch.equal(c.weight.grad, lin.weight.grad.t())
        assert torch.equal(c.bias.grad, lin.bias.grad)


def test_a_conv1d_with_a_precision_computes_as_the_same_linear_and_keeps_its_state_dict() -> None:
    conv, linear = _conv1d_and_linear(torch.float32)
    keys = {k: v.shape for k, v in conv.state_dict().items()}
    for name in ("0", "2"):
        mixprec.set_layer_precision(conv, name, "bf16")
        mixprec.set_layer_precision(linear, name, "bf16")
    x = torch.randn(4, 32)
    assert bitwise_equal(_fwd_bwd(conv, x, region=False), _fwd_bwd(linear, x, region=False))
    mixprec.set_layer_precision(conv, "0", "fp8-tensorwise")
    assert {k: v.shape for k, v in conv.state_dict().items()} == keys


# --- patch convolutions -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("aten_fp8_gemm")
@pytest.mark.parametrize("size", [(16, 16), (18, 17)])  # 18x17: positions past the last whole patch are dropped
def test_a_patch_convolution_in_fp8_is_torchaos_float8_linear_on_unfolded_patches(size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(4, 32, 4, 4))
    linear = nn.Sequential(nn.Linear(64, 32))
    with torch.no_grad():
        linear[0].weight.copy_(conv[0].weight.reshape(32, -1))
        linear[0].bias.copy_(conv[0].bias)
    mixprec.set_layer_precision(conv, "0", "fp8-tensorwise")
    _torchao_convert(linear, "tensorwise")
    x = torch.randn(2, 4, *size, requires_grad=True)
    out = conv(x)
    grid = (size[0] // 4, size[1] // 4)
    patches = nn.functional.unfold(x, 4, stride=4).transpose(1, 2)  # (batch, patches, in * kernel)
    expected = linear(patches).transpose(1, 2).reshape(2, 32, *grid)
    assert out.shape == expected.shape and torch.equal(out, expected)
    torch.testing.assert_close(
        out, nn.functional.conv2d(x, conv[0].weight, conv[0].bias, stride=4), rtol=0.1, atol=0.15
    )
    out.square().sum().backward()
    assert torch.equal(
        conv[0].weight.grad.reshape(32, -1), torch.autograd.grad(expected.square().sum(), linear[0].weight)[0]
    )


# --- MultiheadAttention ---------------------------------------------------------------------------------------


Case = tuple[nn.MultiheadAttention, dict, torch.Tensor]


def _mha_case(batch_first: bool, need_weights: bool, average: bool, mask: str, padding: bool, causal: bool,
              batched: bool, dropout: float, bias: bool) -> Case:  # fmt: skip
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, dropout=dropout, bias=bias, batch_first=batch_first)
    length, batch = 6, 3
    x = torch.randn(*((batch, length) if batch_first else (length, batch)), 32) if batched else torch.randn(length, 32)
    kwargs: dict = {"need_weights": need_weights, "average_attn_weights": average}
    causal_mask = nn.Transformer.generate_square_subsequent_mask(length)
    if mask == "bool":
        kwargs["attn_mask"] = causal_mask < 0
    elif mask == "float":
        kwargs["attn_mask"] = causal_mask
    elif mask == "3d":
        kwargs["attn_mask"] = torch.randn((batch if batched else 1) * 4, length, length)
    if padding and batched:
        pad = torch.zeros(batch, length, dtype=torch.bool)
        pad[0, -2:] = True
        floating = mask in ("float", "3d")  # the masks of one type (torch deprecates mixing them)
        kwargs["key_padding_mask"] = torch.zeros(pad.shape).masked_fill(pad, float("-inf")) if floating else pad
    if causal and mask in ("bool", "float"):
        kwargs["is_causal"] = True
    return mha, kwargs, x


def _attention_run(mha: nn.Module, kwargs: dict, x: torch.Tensor, region: bool) -> tuple:
    torch.manual_seed(1)  # dropout draws the same masks
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
        out, weights = mha(x, x, x, **kwargs)
    out.float().sum().backward()
    grads = [p.grad for p in mha.parameters()]
    return out.detach(), None if weights is None else weights.detach(), x.grad, grads


@settings(max_examples=40, deadline=None)
@given(batch_first=st.booleans(), need_weights=st.booleans(), average=st.booleans(),
       mask=st.sampled_from(["none", "bool", "float", "3d"]), padding=st.booleans(), causal=st.booleans(),
       batched=st.booleans(), dropout=st.sampled_from([0.0, 0.25]), bias=st.booleans(), region=st.booleans(),
       training=st.booleans())  # fmt: skip
def test_a_routed_attention_computes_as_torchs_bitwise(batch_first: bool, need_weights: bool, average: bool,
                                                       mask: str, padding: bool, causal: bool, batched: bool,
                                                       dropout: float, bias: bool, region: bool,
                                                       training: bool) -> None:  # fmt: skip
    mha, kwargs, x = _mha_case(batch_first, need_weights, average, mask, padding, causal, batched, dropout, bias)
    mha.train(training)
    routed = copy.deepcopy(mha)
    holder = nn.Sequential(routed)
    assert attention.route(holder) == ["0"] and attention.is_routed(routed)
    assert list(routed._modules) == ["in_proj", "out_proj"]
    assert set(routed.state_dict()) == set(mha.state_dict())
    try:
        expected = _attention_run(mha, kwargs, x, region)
    except (RuntimeError, AssertionError) as error:  # torch refuses the combination: so must the routed forward
        with pytest.raises(type(error)):
            _attention_run(routed, kwargs, x, region)
        return
    got = _attention_run(routed, kwargs, x, region)
    if batched:
        assert bitwise_equal(got, expected)
        return
    # Unbatched, torch unsqueezes query, key and value apart, so they are no longer one tensor and it projects
    # them with three GEMMs; the routed forward keeps one packed projection (one layer). The forward is still
    # bitwise; the gradients sum the three parts in another order (bf16 parts in a region).
    assert bitwise_equal(got[:2], expected[:2])
    tolerance = {"rtol": 2**-6, "atol": 1e-2} if region else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got[2:], expected[2:], **tolerance)


class _ExplicitAttention(nn.Module):
    """Self-attention written out: q, k, v from one linear, torch's SDPA, an output linear."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.heads = mha.num_heads
        self.in_proj = nn.Linear(mha.embed_dim, 3 * mha.embed_dim)
        self.out_proj = nn.Linear(mha.embed_dim, mha.embed_dim)
        with torch.no_grad():
            self.in_proj.weight.copy_(mha.in_proj_weight)
            self.in_proj.bias.copy_(mha.in_proj_bias)
            self.out_proj.weight.copy_(mha.out_proj.weight)
            self.out_proj.bias.copy_(mha.out_proj.bias)

    def forward(self, x: torch.Tensor, *_: object, **__: object) -> tuple[torch.Tensor, None]:
        length, batch, embed = x.shape  # sequence first, as MultiheadAttention computes
        q, k, v = self.in_proj(x).unflatten(-1, (3, embed)).unbind(-2)
        q, k, v = (t.reshape(length, batch * self.heads, -1).transpose(0, 1) for t in (q, k, v))
        q, k, v = (t.view(batch, self.heads, length, -1) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(length * batch, embed)
        return self.out_proj(out).view(length, batch, embed), None


@pytest.mark.usefixtures("aten_fp8_gemm")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_attention_in_fp8_equals_explicit_qkv_and_out_projections_in_torchaos_float8(recipe: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4)
    explicit = _torchao_convert(_ExplicitAttention(mha), recipe)
    ours = nn.Sequential(mha)
    layers = fp8_conversion.convert(ours, mixprec.Fp8Config(recipe, convert_head=True), set())
    assert layers.converted == ["0.in_proj", "0.out_proj"]
    x = torch.randn(16, 3, 64)
    ours_run = _attention_run(mha, {"need_weights": False}, x, region=False)
    theirs_run = _attention_run(explicit, {}, x, region=False)
    assert bitwise_equal(ours_run[0], theirs_run[0]) and bitwise_equal(ours_run[2], theirs_run[2])
    grads = dict(zip(("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"), ours_run[3], strict=True))
    assert torch.equal(grads["in_proj_weight"], explicit.in_proj.weight.grad)
    assert torch.equal(grads["out_proj.weight"], explicit.out_proj.weight.grad)


def test_an_attention_in_fp8_keeps_its_state_dict_and_loads_an_unconverted_checkpoint() -> None:
    torch.manual_seed(0)
    plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    model = copy.deepcopy(plain)
    mixprec.prepare(model, torch.optim.AdamW(model.parameters()), "O1", fp8="tensorwise")
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    model.load_state_dict(plain.state_dict())  # strict
    assert mixprec.fp8_layers(model).converted[:2] == ["layers.0.self_attn.in_proj", "layers.0.self_attn.out_proj"]  # type: ignore[union-attr]


def test_cross_attention_warns_once_and_still_calls_its_out_projection() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(32, 4))
    mixprec.set_layer_precision(model, "0.in_proj", "bf16")
    mixprec.set_layer_precision(model, "0.out_proj", "bf16")
    q, kv = torch.randn(5, 2, 32), torch.randn(7, 2, 32)
    with pytest.warns(UserWarning, match="cross-attention"):
        out, _ = model[0](q, kv, kv)
    assert out.dtype == torch.float32  # the out-projection's bf16 result, cast back outside a region
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model[0](q, kv, kv)  # once


def test_an_attention_that_cannot_be_routed_is_reported_not_silently_left() -> None:
    model = nn.Sequential(nn.MultiheadAttention(32, 4, add_bias_kv=True), nn.Linear(32, 32))
    layers = fp8_conversion.convert(model, mixprec.Fp8Config(convert_head=True), set())
    skipped = dict(layers.skipped)
    assert layers.converted == ["1"]
    assert "add_bias_kv=True" in skipped["0"] and "its owner never calls it" in skipped["0.out_proj"]


# --- torch's fused inference path ----------------------------------------------------------------------------


def test_an_encoder_in_evaluation_computes_its_layers_own_precision_not_torchs_fused_path() -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
    x = torch.randn(3, 8, 32)
    padding = torch.zeros(3, 8, dtype=torch.bool)
    padding[0, -3:] = True
    for i in range(2):
        for name in ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2"):
            mixprec.set_layer_precision(model, f"layers.{i}.{name}", "bf16")
    with torch.no_grad():
        trained_path = model(x, src_key_padding_mask=padding)  # training mode: the layers' own forwards
        model.eval()
        evaluated = model(x, src_key_padding_mask=padding)
    assert torch.equal(evaluated, trained_path)


# --- Hugging Face models and the reach report ----------------------------------------------------------------


def _hf_models() -> dict[str, tuple[nn.Module, dict]]:
    tf = transformers
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    return {
        "gpt2": (tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32)),
                 {"input_ids": ids}),
        "bert": (tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, **small)), {"input_ids": ids}),
        "llama": (tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, num_key_value_heads=2, **small)),
                  {"input_ids": ids}),
        "t5": (tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                                         num_layers=2, num_heads=4)),
               {"input_ids": ids, "decoder_input_ids": ids}),
        "vit": (tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=4, num_labels=10, **small)),
                {"pixel_values": torch.randn(2, 3, 32, 32)}),
        "encoder": (nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2),
                                  nn.Linear(64, 128)), torch.randn(2, 16, 64)),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5", "vit", "encoder"])
def test_every_gemm_but_the_head_is_reached(name: str) -> None:
    model, batch = _hf_models()[name]
    reach = mixprec.gemm_reach(model, batch)
    assert reach.share("per-layer") == 1.0 and reach.share_of_rest("fp8") == 1.0, str(reach)
    assert not reach.outside and all(r.calls > 0 for r in reach.layers)
    (head,) = [r for r in reach.layers if r.why_not["fp8"] is not None]
    assert head.why_not["fp8"].startswith("the output head")  # type: ignore[union-attr]
    assert 0 < reach.activation_flops < reach.weight_flops
    assert "attention-in" in {r.kind for r in reach.layers} or name != "encoder"
    assert "conv1d" in {r.kind for r in reach.layers} or name != "gpt2"
    assert "patch" in {r.kind for r in reach.layers} or name != "vit"


def test_what_no_layer_holds_is_reported_with_its_share_and_reason() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), _OwnForward(64, 64), nn.MultiheadAttention(64, 4, kdim=32, vdim=32))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body[1](self.body[0](x))
            return self.body[2](h, x, x)[0]

    reach = mixprec.gemm_reach(Wrap(), torch.randn(8, 1, 32))
    outside = {name: why for name, _, why in reach.outside}
    assert "overrides Linear's forward" in outside["body.1"] and "separate q/k/v weights" in outside["body.2"]
    assert 0 < reach.share("per-layer") < 0.5  # one 32x64 linear of five GEMMs' FLOPs
    assert "left out body.1" in str(reach)


def test_gpt2_trains_in_fp8_delayed_and_the_guard_moves_a_planted_overflowing_c_fc() -> None:
    model, batch = _hf_models()["gpt2"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = mixprec.prepare(model, optimizer, "O1", fp8="delayed")
    converted = mixprec.fp8_layers(model).converted  # type: ignore[union-attr]
    assert converted == [f"transformer.h.{i}.{n}" for i in range(2)
                         for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    guard = mixprec.Guard(model, names=("transformer.h.*.mlp.c_fc",))
    assert list(guard.layers) == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    losses = []
    for step in range(14):
        if step >= 8:
            with torch.no_grad():  # planted: the first c_fc's weight grows 8x a step, past what its history saw
                model.transformer.h[0].mlp.c_fc.weight.mul_(8.0)
        optimizer.zero_grad()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        guard.step()
        losses.append(loss.item())
    assert losses[7] < losses[0]
    assert [(m.layer, m.from_, m.to, m.signal, m.step) for m in guard.moves] == [
        ("transformer.h.0.mlp.c_fc", "fp8-delayed", "fp8-tensorwise", "saturated", 10)], guard.moves  # fmt: skip
    assert mixprec.layer_precision(model, "transformer.h.0.mlp.c_fc") == "fp8-tensorwise"
    assert all(torch.isfinite(torch.tensor(losses)))


def test_sites_leave_an_unrouted_models_attentions_alone() -> None:
    model = nn.Sequential(nn.MultiheadAttention(32, 4))
    assert [n for n, _, _ in sites.gemm_layers(model, route=False)] == []
    assert not attention.is_routed(model[0])


def test_the_output_head_is_never_an_attentions_projection() -> None:
    class HeadFirst(nn.Module):  # registers its head before its attention
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(32, 16)
            self.attn = nn.MultiheadAttention(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x)[0])

    layers = fp8_conversion.convert(HeadFirst(), mixprec.Fp8Config(), set())
    assert layers.converted == ["attn.in_proj", "attn.out_proj"]
    assert dict(layers.skipped)["head"].startswith("the output head")


def test_the_per_layer_plan_says_what_share_of_the_gemms_its_layers_hold() -> None:
    from mixprec._src.layers import plan

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(64, 32), nn.GELU(), _OwnForward(64, 64), nn.Linear(64, 8))
    measured, notes = plan.measure(model, torch.randn(16, 32), lambda out: out.square().mean(), ["bf16"], 1e12)
    assert [m.name for m in measured] == ["0", "3"] and measured[0].shape.startswith("conv1d 32->64, 16 rows")
    (note,) = [n for n in notes if n.startswith("per-layer plan: its layers hold")]
    # Conv1D 2*32*64 and the head 2*64*8 per row, of those and the subclass's 2*64*64
    assert "hold 38.5% of the forward's weight-GEMM FLOPs" in note
    assert "not layers: 2 (61.5%: _OwnForward overrides Linear's forward" in note


def test_a_projection_named_on_a_fresh_model_is_found_as_a_guards_resume_replays_it() -> None:
    torch.manual_seed(0)
    fresh = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 1)
    assert not attention.is_routed(fresh.layers[0].self_attn)
    mixprec.set_layer_precision(fresh, "layers.0.self_attn.in_proj", "bf16")  # routes on demand
    assert mixprec.layer_precision(fresh, "layers.0.self_attn.in_proj") == "bf16"
    assert attention.is_routed(fresh.layers[0].self_attn)


def test_an_attention_in_fp8_recomputes_under_activation_checkpointing_as_it_computed() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    fp8_conversion.convert(layer, mixprec.Fp8Config(convert_head=True), set())
    x = torch.randn(2, 16, 32)

    def run(checkpointed: bool) -> tuple[torch.Tensor, ...]:
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        out.float().square().sum().backward()
        return (out.detach(), *(p.grad.clone() for p in layer.parameters()))  # type: ignore[union-attr]

    assert bitwise_equal(run(True), run(False))
