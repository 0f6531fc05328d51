"""set_layer_precision: one linear or convolution in its own precision, inside and outside a region."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import bitwise_equal
from mixprec._src.fp8.conversion import is_converted
from mixprec._src.layers.precision import PRECISIONS, parse_precision


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_layer_computes_in_its_dtype_inside_a_bf16_region(dtype: torch.dtype) -> None:
    net = _net()
    mixprec.set_layer_precision(net, "2", dtype)
    x = torch.randn(8, 16)
    seen: dict[str, torch.dtype] = {}
    for name in ("0", "2", "4"):
        net.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, o.dtype))
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        net(x)
    assert seen == {"0": torch.bfloat16, "2": dtype, "4": torch.bfloat16}
    # its output is exactly F.linear in that dtype on the input the region gave it
    layer, h = net[2], F.gelu(F.linear(x.bfloat16(), net[0].weight.bfloat16(), net[0].bias.bfloat16()))
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = layer(h)
    assert bitwise_equal(out, F.linear(h.to(dtype), layer.weight.to(dtype), layer.bias.to(dtype)))
    assert mixprec.layer_precision(net, "2") == {torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    assert mixprec.layer_precision(net, "0") is None


def test_outside_a_region_a_low_precision_layer_hands_back_the_input_dtype() -> None:
    net = _net()
    mixprec.set_layer_precision(net, "2", "bf16")
    x = torch.randn(8, 16, requires_grad=True)
    out = net(x)
    assert out.dtype is torch.float32  # the next fp32 layer runs
    out.sum().backward()
    assert net[2].weight.grad is not None and net[2].weight.grad.dtype is torch.float32
    h = F.gelu(net[0](x.detach()))
    expected = F.linear(h.bfloat16(), net[2].weight.bfloat16(), net[2].bias.bfloat16()).float()
    assert bitwise_equal(net[2](h), expected)


def test_a_convolution_takes_a_dtype() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3))
    mixprec.set_layer_precision(conv, "0", "fp32")
    x = torch.randn(2, 3, 8, 8)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x)
    assert out.dtype is torch.float32 and bitwise_equal(out, F.conv2d(x, conv[0].weight, conv[0].bias))


def test_fp8_on_one_layer_is_the_layer_prepare_makes_and_moves_back() -> None:
    net, ref = _net(), _net()
    mixprec.set_layer_precision(net, "2", "fp8-tensorwise")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref, _ = mixprec.prepare(ref, opt, "O1", fp8=mixprec.Fp8Config("tensorwise", names="2"))
    x = torch.randn(8, 16)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        assert bitwise_equal(net[2](net[1](net[0](x))), ref[2](ref[1](ref[0](x))))
    layers = mixprec.fp8_layers(net)
    assert layers is not None and layers.converted == ["2"] and mixprec.layer_precision(net, "2") == "fp8-tensorwise"
    keys = set(net.state_dict())
    mixprec.set_layer_precision(net, "2", "fp8-rowwise")  # another recipe: a new scaling
    assert mixprec.layer_precision(net, "2") == "fp8-rowwise" and layers.converted == ["2"]
    mixprec.set_layer_precision(net, "2", "bf16")
    assert not is_converted(net[2]) and mixprec.layer_precision(net, "2") == "bf16"
    assert layers.converted == [] and ("2", "moved out of fp8") in layers.skipped
    assert set(net.state_dict()) == keys  # a dynamic recipe and a dtype add nothing to the state dict
    mixprec.set_layer_precision(net, "2", None)
    assert mixprec.layer_precision(net, "2") is None and "forward" not in net[2].__dict__


def test_what_cannot_be_set_raises_with_what_to_do() -> None:
    net = nn.Sequential(nn.Linear(16, 40), nn.LayerNorm(40), nn.Conv1d(4, 4, 3))
    with pytest.raises(ValueError, match=r"a LayerNorm is not a GEMM layer; per-layer precision applies to linears"):
        mixprec.set_layer_precision(net, "1", "fp32")
    with pytest.raises(ValueError, match="unknown layer precision 'fp4'"):
        mixprec.set_layer_precision(net, "0", "fp4")
    with pytest.raises(ValueError, match="not a multiple of 16"):
        mixprec.set_layer_precision(net, "0", "fp8-tensorwise")
    with pytest.raises(ValueError, match=r"a convolution layer: fp8 computes the GEMMs of linear kinds"):
        mixprec.set_layer_precision(net, "2", "fp8-tensorwise")
    with pytest.raises(ValueError, match="unknown fp8 recipe"):
        parse_precision("fp8-blockwise")


def test_precision_names() -> None:
    assert [parse_precision(p) for p in PRECISIONS] == list(PRECISIONS)
    assert parse_precision(torch.bfloat16) == parse_precision("bfloat16") == "bf16"


def test_a_model_with_its_own_layer_precisions_saves_and_loads_whole(tmp_path: pathlib.Path) -> None:
    net = _net()
    mixprec.set_layer_precision(net, "0", "bf16")
    mixprec.set_layer_precision(net, "2", "fp8-tensorwise")
    torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    assert [mixprec.layer_precision(loaded, n) for n in ("0", "2", "4")] == ["bf16", "fp8-tensorwise", None]
    x = torch.randn(8, 16)
    assert bitwise_equal(loaded(x), net(x))
    assert loaded[0].forward.module is loaded[0]  # bound to the loaded layer, not the saved one


def test_prepare_with_fp8_leaves_a_layers_own_precision_alone() -> None:
    net = _net()
    mixprec.set_layer_precision(net, "0", "fp32")
    mixprec.set_layer_precision(net, "2", "fp8-rowwise")
    net, _ = mixprec.prepare(
        net,
        torch.optim.SGD(net.parameters(), lr=0.1),
        "O1",
        fp8="tensorwise",
    )
    assert mixprec.layer_precision(net, "0") == "fp32" and mixprec.layer_precision(net, "2") == "fp8-rowwise"
    layers = mixprec.fp8_layers(net)
    assert layers is not None and ("0", "its forward is its own (mixprec.set_layer_precision, or another "
                                        "library's): left as it is") in layers.skipped  # fmt: skip


def test_a_subclass_or_an_unknown_name_is_refused_and_delayed_fp8_is_whole_model() -> None:
    class OwnForward(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    with pytest.raises(ValueError, match=r"OwnForward overrides Linear's forward \(in OwnForward\): it may compute"):
        mixprec.set_layer_precision(nn.Sequential(OwnForward(16, 16)), "0", "fp32")
    # an attention that cannot be routed: its out_proj never runs as a module
    attention = nn.Sequential(nn.MultiheadAttention(16, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"add_bias_kv=True\): its owner never calls it"):
        mixprec.set_layer_precision(attention, "0.out_proj", "fp32")
    with pytest.raises(ValueError, match="the model has no module 'nope'"):
        mixprec.set_layer_precision(_net(), "nope", "fp32")
    with pytest.raises(ValueError, match="fp8-delayed keeps an amax history"):
        mixprec.set_layer_precision(_net(), "2", "fp8-delayed")


@pytest.mark.slow
@pytest.mark.parametrize("backward_autocast", ["same_as_forward", "off"])
def test_under_compile_a_layers_backward_is_eagers_whatever_torchs_default(backward_autocast: str) -> None:
    # torch compiles a backward under the forward's autocast by default (pytorch#153044): a layer kept in fp32
    # inside an fp16 region would get fp16 gradients, which overflow here; mixprec compiles it as eager runs it.
    with torch._functorch.config.patch(backward_pass_autocast=backward_autocast):
        grads = _compiled_and_eager_grads()
    assert torch.isfinite(grads[0]).all()
    assert torch.equal(grads[1], grads[0])


def _compiled_and_eager_grads() -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    mixprec.set_layer_precision(model, "0", "fp32")
    x = torch.randn(64, 32) * 3e4
    grads = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = run(x)
        out.float().square().mean().backward()
        grads.append(model[0].weight.grad.clone())
    torch._dynamo.reset()
    return grads
