"""MXFP8 and NVFP4 layers: each of a linear's three GEMMs against a dequantize-then-GEMM reference written
here, torchao's emulated MX GEMM bit for bit, the NVFP4 recipe's parts, and training through prepare."""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from helpers import bitwise_equal, sqnr
from mixprec._src.fp8 import block_formats as bf
from mixprec._src.fp8 import block_gemm
from mixprec._src.fp8 import conversion as fp8_conversion


def _layer(config: mixprec.Fp8Config, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(dtype)
    model = nn.Sequential(layer)
    fp8_conversion.convert(model, config, set())
    assert fp8_conversion.is_converted(layer)
    return layer


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad  # type: ignore[union-attr,return-value]


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _mx(t: torch.Tensor, mode: str) -> torch.Tensor:
    """MXFP8 of a 2-D tensor along its rows, the last block zero-padded to 32."""
    padded = _pad(t, t.shape[0], -(-t.shape[1] // 32) * 32)
    return bf.mx_dequantize(*bf.mx_quantize(padded, torch.float8_e4m3fn, mode))[:, : t.shape[1]]


def _nv(t: torch.Tensor, tile: bool = False) -> torch.Tensor:
    """NVFP4 of a 2-D tensor along its rows with a tensor scale; ``tile``: 16x16 tiles (rows padded too)."""
    rows = -(-t.shape[0] // 16) * 16 if tile else t.shape[0]
    padded = _pad(t, rows, -(-t.shape[1] // 16) * 16)
    scale = padded.abs().amax() / (448.0 * 6.0)
    return bf.nvfp4_dequantize(*bf.nvfp4_quantize(padded, scale, tile=tile), scale)[: t.shape[0], : t.shape[1]]


def _rotated(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, tokens) times the block-diagonal matrix of random 16x16 Hadamard blocks over its tokens."""
    tokens = -(-t.shape[1] // 16) * 16
    blocks = torch.block_diag(*[block_gemm.hadamard_matrix(torch.device("cpu"))] * (tokens // 16))
    return _pad(t, t.shape[0], tokens) @ blocks


def _reference(
    recipe: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, mode: str = "rceil"
) -> tuple[torch.Tensor, ...]:
    """The three GEMMs, each operand quantized along that GEMM's reduction dim and dequantized, in fp32."""
    if recipe == "mxfp8":
        out = _mx(x, mode) @ _mx(w, mode).T + b
        grad_x = _mx(grad, mode) @ _mx(w.T, mode).T
        grad_w = _mx(grad.T, mode) @ _mx(x.T, mode).T
    else:  # nvfp4 with tiles and the Hadamard transform, gradients rounded to nearest
        out = _nv(x) @ _nv(w, tile=True).T + b
        grad_x = _nv(grad) @ _nv(w.T, tile=True).T
        grad_w = _nv(_rotated(grad.T)) @ _nv(_rotated(x.T)).T
    return out, grad_x, grad_w, grad.sum(0)


CONFIGS = {
    "mxfp8": mixprec.Fp8Config("mxfp8", convert_head=True),
    "mxfp8-floor": mixprec.Fp8Config("mxfp8", convert_head=True, scale_mode="floor"),
    "nvfp4": mixprec.Fp8Config("nvfp4", convert_head=True, keep_last=0.0, stochastic_grads=False),
}


@pytest.mark.parametrize("tokens", [48, 40])  # 40: the weight gradient's reduction padded with zeros
@pytest.mark.parametrize("name", CONFIGS)
def test_each_gemm_is_the_dequantize_then_gemm_reference(name: str, tokens: int) -> None:
    layer = _layer(CONFIGS[name])
    x, grad = torch.randn(tokens, 64), torch.randn(tokens, 48)
    got = _run(layer, x, grad)
    mode = "floor" if name.endswith("floor") else "rceil"
    want = _reference(name.split("-")[0], x, layer.weight.detach(), layer.bias.detach(), grad, mode)
    for g, r, what in zip(got, want, ("output", "input gradient", "weight gradient", "bias gradient"), strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5), what
    plain = nn.Linear(64, 48)
    plain.load_state_dict(layer.state_dict())
    exact = _run(plain, x, grad)
    floors = {"mxfp8": 28.0, "mxfp8-floor": 22.0, "nvfp4": 12.0}[name]  # the format's error, no more
    got_sqnr = [sqnr(g, e) for g, e in zip(got[:3], exact[:3], strict=True)]
    assert min(got_sqnr) > floors, got_sqnr


def test_mxfp8_gemm_is_torchaos_emulated_mx_gemm_bit_for_bit() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    x, w = torch.randn(40, 64), torch.randn(48, 64)
    for mode in ("floor", "rceil"):
        a, b = (mx_tensor.MXTensor.to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode(mode),
                                        KernelPreference.EMULATED) for t in (x, w))  # fmt: skip
        scaling = block_gemm.BlockScaling(block_gemm.MX, torch.float8_e4m3fn, bf.ScaleMode(mode))
        assert bitwise_equal(block_gemm.block_gemm(x, scaling, w.t(), scaling, torch.float32), torch.mm(a, b.t()))


def test_nvfp4_parts_each_change_the_numbers_they_own() -> None:
    x, grad = torch.randn(48, 64) * torch.logspace(-2, 2, 64), torch.randn(48, 48)
    full = dict(convert_head=True, keep_last=0.0, stochastic_grads=False)
    base = _run(_layer(mixprec.Fp8Config("nvfp4", **full)), x, grad)  # type: ignore[arg-type]
    no_tiles = _run(_layer(mixprec.Fp8Config("nvfp4", **{**full, "tiles": False})), x, grad)  # type: ignore[arg-type]
    no_rotation = _run(_layer(mixprec.Fp8Config("nvfp4", **{**full, "hadamard": False})), x, grad)  # type: ignore[arg-type]
    # 16x16 tiles change the weight's casts: the output and the input gradient; the weight gradient's GEMM
    # has no weight in it
    assert not torch.equal(base[0], no_tiles[0]) and not torch.equal(base[1], no_tiles[1])
    assert torch.equal(base[2], no_tiles[2])
    # the Hadamard transform changes the weight gradient only
    assert torch.equal(base[0], no_rotation[0]) and torch.equal(base[1], no_rotation[1])
    assert not torch.equal(base[2], no_rotation[2])


def test_stochastic_gradients_draw_new_noise_each_backward_and_average_out() -> None:
    layer = _layer(mixprec.Fp8Config("nvfp4", convert_head=True, keep_last=0.0))
    x, grad = torch.randn(32, 64), torch.randn(32, 48)
    draws = [_run(layer, x, grad) for _ in range(64)]
    assert not torch.equal(draws[0][1], draws[1][1]) and not torch.equal(draws[0][2], draws[1][2])
    assert all(torch.equal(d[0], draws[0][0]) for d in draws)  # the forward has no gradient in it
    unrounded = grad @ _nv(layer.weight.detach().T, tile=True).T  # the input gradient had go not been rounded
    mean = torch.stack([d[1] for d in draws]).mean(0)
    # unbiased: the mean of 64 draws is much closer to it than one draw (64 draws: up to 18 dB)
    assert sqnr(mean, unrounded) > sqnr(draws[0][1], unrounded) + 12


def test_nvfp4_keeps_its_last_layers_in_high_precision() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(32, 32), nn.ReLU()) for _ in range(7)))
    layers = fp8_conversion.convert(model, mixprec.Fp8Config("nvfp4", convert_head=True), set())
    assert layers.converted == ["0", "2", "4", "6", "8", "10"]  # the last of 7 (15%: one) is left
    assert "12" in dict(layers.skipped) and "keep_last=0" in dict(layers.skipped)["12"]
    everything = fp8_conversion.convert(
        nn.Sequential(nn.Linear(32, 32)), mixprec.Fp8Config("nvfp4", convert_head=True, keep_last=0.0), set()
    )
    assert everything.converted == ["0"]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(recipe="tensorwise", scale_mode="floor"), "scale_mode"),
        (dict(recipe="mxfp8", hadamard=False), "nvfp4 recipe's parts"),
        (dict(recipe="nvfp4", keep_last=1.0), "keep_last"),
        (dict(recipe="mxfp8", all_gather=True), "per block"),
        (dict(recipe="mxfp8", scale_mode="even"), "MX scale mode"),
    ],
)
def test_block_options_are_refused_where_they_mean_nothing(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mixprec.Fp8Config(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("level", ["O1", "O2", "bf16-pure", "bf16-sr", "bf16-kahan"])
def test_block_recipes_train_at_every_level(recipe: str, level: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = mixprec.Fp8Config(recipe, **({"keep_last": 0.0} if recipe == "nvfp4" else {}))  # type: ignore[arg-type]
    model, opt = mixprec.prepare(model, opt, level, fp8=config)
    assert len(mixprec.fp8_layers(model).converted) == 2  # type: ignore[union-attr]
    x, y = torch.randn(64, 32), torch.randn(64, 8)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_one_layer_takes_a_block_format_of_its_own(precision: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    mixprec.set_layer_precision(model, "0", precision)
    assert mixprec.layer_precision(model, "0") == precision and mixprec.layer_precision(model, "2") is None
    assert mixprec.LayerPrecision.from_name(precision).block
    nearest: dict[str, Any] = {"stochastic_grads": False, "keep_last": 0.0} if precision == "nvfp4" else {}
    config = mixprec.Fp8Config(precision, convert_head=True, **nearest)
    if precision == "nvfp4":  # one layer's recipe: rounding to nearest here, to compare bit for bit
        mixprec.set_layer_precision(model, "0", None)
        fp8_conversion.set_layer(model, "0", config)
    reference = _layer(config)
    x = torch.randn(40, 64)
    got, want = model[0](x), reference(x)
    assert bitwise_equal(got, want)
    mixprec.set_layer_precision(model, "0", "bf16")
    assert mixprec.layer_precision(model, "0") == "bf16" and not fp8_conversion.is_converted(model[0])


def test_layer_precision_takes_the_names_gemm_reach_gives() -> None:
    model = nn.Sequential(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True))
    names = [layer.name for layer in mixprec.gemm_reach(model, torch.randn(2, 8, 32)).layers]
    assert "0.self_attn.in_proj" in names
    assert [mixprec.layer_precision(model, n) for n in names] == [None] * len(names)
    mixprec.set_layer_precision(model, "0.self_attn.in_proj", "mxfp8")
    assert mixprec.layer_precision(model, "0.self_attn.in_proj") == "mxfp8"


def _saturating_input() -> torch.Tensor:
    """Every block of 32 holds one value at 1.9 times a power of two: floor's scale leaves it past e4m3's 448."""
    x = torch.randn(32, 64) * 0.1
    x[:, ::32] = 1.9 * 2.0 ** torch.randint(0, 4, (32, 2)).float()  # the largest of its block (randn * 0.1 < 1)
    return x


@pytest.mark.parametrize(("mode", "saturated"), [("floor", 1.0), ("rceil", 0.0)])
def test_diagnose_reports_the_share_of_blocks_that_saturated(mode: str, saturated: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    report = mixprec.diagnose(
        model, _saturating_input(), dtype="bf16", fp8=mixprec.Fp8Config("mxfp8", scale_mode=mode, convert_head=True)
    )
    first = next(r for r in report.fp8 if r.name == "0")
    assert first.block and first.casts["input"]["saturated"] == saturated
    assert "saturated blocks" in str(first)
    if mode == "rceil":  # rceil's scale never leaves a value past the max
        assert all(c["saturated"] == 0.0 for c in first.casts.values())
    again = type(first).from_dict(first.to_dict())
    assert again == first


def test_a_loaded_layer_draws_the_rounding_noise_the_saved_one_would_have_drawn() -> None:
    layer = _layer(mixprec.Fp8Config("nvfp4", convert_head=True, keep_last=0.0))
    x, grad = torch.randn(32, 64), torch.randn(32, 48)
    for _ in range(3):
        _run(layer, x, grad)
    state = copy.deepcopy(layer.state_dict())
    assert state["fp8.noise"][1] == 3  # one count a backward
    fresh = _layer(mixprec.Fp8Config("nvfp4", convert_head=True, keep_last=0.0))
    fresh.load_state_dict(state)
    assert bitwise_equal(_run(fresh, x, grad), _run(layer, x, grad))
    plain = _layer(mixprec.Fp8Config("mxfp8", convert_head=True))
    assert "fp8.noise" not in plain.state_dict()
    plain.load_state_dict(state, strict=False)  # a checkpoint with a counter loads into a layer without one


def test_fp8_layers_and_gemm_reach_name_the_block_format_and_what_it_leaves() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(32, 32), nn.ReLU()) for _ in range(8)))
    reach = mixprec.gemm_reach(model, torch.randn(4, 32), fp8="nvfp4")
    left = {name: why for name, _, why in reach.left_out("fp8")}
    assert "14" in left and "head" in left["14"] and "12" in left and "leaves in bf16" in left["12"]
    opt = torch.optim.AdamW(model.parameters())
    model, opt = mixprec.prepare(model, opt, "O1", fp8="nvfp4")
    layers = mixprec.fp8_layers(model)
    assert layers is not None and "6 layer(s) in nvfp4" in str(layers)
    prepared_reach = mixprec.gemm_reach(model, torch.randn(4, 32))
    assert {n for n, _, _ in prepared_reach.left_out("fp8")} == {"12", "14"}
