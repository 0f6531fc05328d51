"""fp8 linears: numerics per recipe (SQNR, torchao, a plain delayed-scaling reference), and how they
compose with autocast, policies, activation checkpointing and torch.compile."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from helpers import bitwise_equal, requires_cuda, sqnr
from mixprec._src.fp8 import conversion as fp8_conversion

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]
# Floors (dB) against a bf16 reference for the layer below; what each recipe reaches is printed by
# `python benchmarks/bench_fp8.py --sqnr-only` (output / weight gradient / input gradient, measured:
# tensorwise and delayed 28.7 / 25.6 / 26.8, rowwise 28.9 / 27.8 / 28.8, rowwise_with_gw_hp 28.9 / 30.3 / 28.8).
FLOORS = {"output": 25.0, "weight gradient": 23.0, "input gradient": 23.0}


def fp8_model(recipe: str | mixprec.Fp8Config, *sizes: int, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(dtype)
    config = recipe if isinstance(recipe, mixprec.Fp8Config) else mixprec.Fp8Config(recipe, convert_head=True)
    fp8_conversion.convert(model, config, set())
    return model


def forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]  # type: ignore[return-value]


@pytest.mark.parametrize("recipe", RECIPES)
def test_sqnr_against_bf16_reference(recipe: str) -> None:
    model = fp8_model(recipe, 256, 512, dtype=torch.bfloat16)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16)  # the batch bench_fp8.py --sqnr-only measures
    reference = nn.Sequential(nn.Linear(256, 512)).bfloat16()
    reference.load_state_dict(model.state_dict(), strict=False)
    out, gx, gw = forward_backward(model, x)
    ref_out, ref_gx, ref_gw = forward_backward(reference, x)
    got = {"output": sqnr(out, ref_out), "weight gradient": sqnr(gw[0], ref_gw[0]),
           "input gradient": sqnr(gx, ref_gx)}  # fmt: skip
    assert all(got[k] >= FLOORS[k] for k in FLOORS), got


def _torchao_model(recipe: str, model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float8 = pytest.importorskip("torchao.float8")
    theirs = copy.deepcopy(model)
    fp8_conversion.revert(theirs)
    float8.convert_to_float8_training(theirs, config=float8.Float8LinearConfig.from_recipe_name(recipe))
    return theirs


@pytest.mark.usefixtures("aten_fp8_gemm")
@pytest.mark.parametrize("tokens", [48, 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_bitwise_equal_to_torchao_float8_linear(recipe: str, dtype: torch.dtype, tokens: int) -> None:
    ours = fp8_model(recipe, 64, 128, 32, dtype=dtype)
    theirs = _torchao_model(recipe, ours)
    x = torch.randn(tokens, 64, dtype=dtype)  # 30 tokens: mixprec pads the weight gradient's GEMM, torchao does not
    assert bitwise_equal(forward_backward(ours, x), forward_backward(theirs, x))


@pytest.mark.usefixtures("aten_fp8_gemm")
@pytest.mark.parametrize(("recipe", "reads"), [("tensorwise", 5), ("delayed", 0), ("rowwise", 6)])
def test_the_output_gradient_is_read_for_its_amax_once_a_backward(
    recipe: str, reads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamic tensorwise scaling reads the output gradient for its amax once (the weight gradient's cast takes the
    scale the input gradient's made: bit for bit torchao's, above), the input and the weight in each pass; delayed
    scaling reads them for its record, not in the GEMMs; rowwise scales each cast along another axis, so every cast
    reads."""
    from mixprec._src.fp8 import gemm as fp8_gemm

    read: list[torch.Tensor] = []
    amax_of = fp8_gemm.amax_of

    def counted(t: torch.Tensor, *args: Any) -> torch.Tensor:
        read.append(t)
        return amax_of(t, *args)

    monkeypatch.setattr(fp8_gemm, "amax_of", counted)
    model = fp8_model(recipe, 64, 32, dtype=torch.bfloat16)
    forward_backward(model, torch.randn(48, 64, dtype=torch.bfloat16))
    assert len(read) == reads


class DelayedReference:
    """Transformer Engine's delayed scaling written plainly: a Python list of amaxes per tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, history_len: int, margin: int, algo: str) -> None:
        self.weight, self.bias = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        self.history: dict[str, list[float]] = {"x": [], "w": [], "g": []}
        self.pending = {"x": 0.0, "w": 0.0, "g": 0.0}
        self.len, self.margin, self.algo = history_len, margin, algo

    def qdq(self, t: torch.Tensor, role: str, dtype: torch.dtype) -> torch.Tensor:
        now = t.abs().max().item()
        past = self.history[role]
        amax = (max(past) if self.algo == "max" else past[0]) if past and max(past) > 0 else now
        self.pending[role] = max(self.pending[role], now)
        scale = torch.tensor(torch.finfo(dtype).max / max(amax, 1e-12) / 2**self.margin, dtype=torch.float64).float()
        limit = torch.finfo(dtype).max
        return (t.float() * scale).clamp(-limit, limit).to(dtype).float() * scale.reciprocal()

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq = self.qdq(x, "x", torch.float8_e4m3fn)
        wq = self.qdq(self.weight.detach(), "w", torch.float8_e4m3fn)
        out = xq @ wq.t() + self.bias.detach()
        grad = 2 * out
        gq = self.qdq(grad, "g", torch.float8_e5m2)
        grad_w = gq.t() @ xq
        for role in self.history:
            self.history[role] = ([self.pending[role]] + self.history[role])[: self.len]
            self.pending[role] = 0.0
        return out, grad_w


@pytest.mark.parametrize(("history_len", "margin", "algo"), [(4, 0, "max"), (2, 1, "most_recent")])
def test_delayed_scaling_equals_a_plain_reference_step_by_step(history_len: int, margin: int, algo: str) -> None:
    config = mixprec.Fp8Config("delayed", convert_head=True, history_len=history_len, margin=margin, amax_algo=algo)
    model = fp8_model(config, 32, 16)
    layer = model[0]
    ref = DelayedReference(layer.weight, layer.bias, history_len, margin, algo)
    layers = fp8_conversion.fp8_layers(model)
    torch.manual_seed(1)
    for step in range(7):
        x = torch.randn(16, 32) * (1 + 4 * (step % 3))  # amax jumps: the history must lag
        out, _, grads = forward_backward(model, x)
        ref_out, ref_gw = ref.step(x)
        assert torch.equal(out, ref_out), step
        assert torch.equal(grads[0], ref_gw), step
        layers.modules["0"].weight.grad = None  # type: ignore[union-attr]
        layers.modules["0"].bias.grad = None  # type: ignore[union-attr]
        fp8_conversion.advance(layers)  # type: ignore[arg-type]
    assert layer.fp8.history[:, :history_len].flatten().tolist() == pytest.approx(
        [v for role in ("x", "w", "g") for v in ref.history[role]]
    )


def test_recompute_and_micro_batches_do_not_advance_the_history() -> None:
    model = fp8_model(mixprec.Fp8Config("delayed", convert_head=True, history_len=8), 32, 32)
    scaling = model[0].fp8
    x = torch.randn(16, 32)
    checkpoint(model, x.requires_grad_(), use_reentrant=False).square().sum().backward()
    plain = fp8_model(mixprec.Fp8Config("delayed", convert_head=True, history_len=8), 32, 32)
    plain(x).square().sum().backward()
    assert torch.equal(scaling.pending, plain[0].fp8.pending)  # the recompute recorded nothing new
    assert torch.equal(model[0].weight.grad, plain[0].weight.grad)  # the recompute used the forward's scales
    model(x * 3).square().sum().backward()  # a second micro-batch: the pending amax is the larger
    assert scaling.pending[0] == (x * 3).abs().max()
    assert not scaling.history.any()  # nothing joined the history before the optimizer step
    scaling.advance()
    assert scaling.history[0, 0] == (x * 3).abs().max() and not scaling.pending.any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_under_autocast_the_output_dtype_follows_the_policy(recipe: str) -> None:
    model = fp8_model(recipe, 32, 32, 16)
    x = torch.randn(8, 32)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=mixprec.default_policy("cpu").add("fp32", "linear")):
        assert model(x).dtype == torch.float32  # the policy moved linear to fp32
    rule = mixprec.ModuleRule(names="2")
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.default_policy("cpu").with_rules([rule])):
        out = model(x)
    assert out.dtype == torch.float32  # the last layer is kept in fp32 by a rule; the first ran in fp16


def test_layers_seeing_different_dtypes_train_together() -> None:
    """torchao#1297: fp8 layers mixed with autocast and fp32 rules under delayed scaling."""
    model = fp8_model(mixprec.Fp8Config("delayed", convert_head=True), 32, 32, 32, 16)
    policy = mixprec.default_policy("cpu").with_rules([mixprec.ModuleRule(names="2")])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
            loss = model(torch.randn(16, 32)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp8_conversion.advance(fp8_conversion.fp8_layers(model))  # type: ignore[arg-type]
    assert torch.isfinite(loss) and all(m.fp8.history[:, 0].all() for m in model if hasattr(m, "fp8"))


COMPILE_WARNING = pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # Dynamo's own


def _compare_compiled(recipe: str, backend: str, region: bool) -> tuple[Any, Any, nn.Module, nn.Module]:
    torch._dynamo.reset()  # each case compiles a new model: no recompile limit shared across cases
    eager = fp8_model(recipe, 64, 64, 32)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    x = torch.randn(32, 64)
    results = []
    for model in (eager, compiled):
        with mixprec.autocast("cpu", dtype=torch.bfloat16, enabled=region):
            results.append(forward_backward(model, x))
    return results[0], results[1], eager, compiled_model


# Two cases in the default suite (a dynamic and the stateful recipe, under a region), all in the slow one.
COMPILE_CASES = [pytest.param(recipe, region, marks=() if region and recipe in ("tensorwise", "delayed")
                              else pytest.mark.slow, id=f"{recipe}-{'under-autocast' if region else 'fp32'}")
                 for recipe in RECIPES for region in (False, True)]  # fmt: skip


@COMPILE_WARNING
@pytest.mark.parametrize(("recipe", "region"), COMPILE_CASES)
def test_compiled_fullgraph_equals_eager(recipe: str, region: bool) -> None:
    want, got, eager, compiled = _compare_compiled(recipe, "aot_eager", region)
    assert bitwise_equal(want, got)
    if recipe == "delayed":  # the compiled graph recorded the amaxes, forward and backward
        assert torch.equal(compiled[0].fp8.pending, eager[0].fp8.pending)


@pytest.mark.slow
@COMPILE_WARNING
@pytest.mark.parametrize("recipe", RECIPES)
def test_inductor_equals_eager(recipe: str) -> None:
    """Inductor's fused casts and amaxes give eager's bits: outputs, input and weight gradients (fp32
    around the fp8 GEMMs: under bf16 autocast inductor computes the element-wise ops between layers in
    fp32, as it does without fp8). Bias gradients are sums inductor orders its own way: close, not equal."""
    want, got, _, _ = _compare_compiled(recipe, "inductor", False)
    assert bitwise_equal(want[:2], got[:2])
    weights, biases = slice(0, None, 2), slice(1, None, 2)
    assert bitwise_equal(want[2][weights], got[2][weights])
    assert all(sqnr(a, b) > 100 for a, b in zip(got[2][biases], want[2][biases], strict=True))


def test_statistics_count_saturated_and_flushed_values() -> None:
    model = fp8_model(mixprec.Fp8Config("delayed", convert_head=True), 16, 16)
    scaling = model[0].fp8
    scaling.recording = True
    scaling.advance()
    scaling.history[0, 0] = 1.0  # the input's scale is made for amax 1
    x = torch.ones(16, 16) * 0.5
    x[0, :4] = 10.0  # 4 of 256 values past the max after scaling: saturated
    x[1, :8] = 1e-9  # 8 of 256 values below e4m3's smallest subnormal: flushed
    forward_backward(model, x)
    stats: dict[str, Any] = {role: s.as_floats() for role, s in scaling.stats.items()}
    assert set(stats) == {"input", "weight", "grad_output"}
    assert stats["input"]["amax"] == 10.0 and stats["input"]["scale"] == 448.0
    assert stats["input"]["saturated"] == 4 / 256 and stats["input"]["flushed"] == 8 / 256
    assert stats["weight"]["saturated"] == 0.0


def _cuda_fp8_capable(recipe: str) -> bool:
    need = (9, 0) if recipe.startswith("rowwise") else (8, 9)
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= need


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_runs_what_the_cpu_ran(recipe: str) -> None:
    """The same layer and batch on the GPU's fp8 kernels and on the CPU's emulation agree closely."""
    if not _cuda_fp8_capable(recipe):
        with pytest.raises(ValueError, match="compute capability"):
            fp8_conversion.convert(nn.Linear(32, 32).cuda(), mixprec.Fp8Config(recipe, convert_head=True), set())
        return
    cpu = fp8_model(recipe, 256, 512, 128, dtype=torch.bfloat16)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 30, 256, dtype=torch.bfloat16)  # 120 tokens: padded on both devices
    got, want = forward_backward(gpu, x.cuda()), forward_backward(cpu, x)
    assert sqnr(got[0].cpu(), want[0]) > 35 and sqnr(got[2][0].cpu(), want[2][0]) > 30


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_is_not_recorded(bad: float) -> None:
    """An overflowed fp16 step (GradScaler skips it) must not poison the amax history for history_len steps."""
    model = fp8_model(mixprec.Fp8Config("delayed", convert_head=True, history_len=4), 32, 32)
    out = model(torch.randn(16, 32))
    grad = torch.ones_like(out)
    grad[0, 0] = bad
    out.backward(grad)
    scaling = model[0].fp8
    assert scaling.pending[2] == 0.0 and torch.isfinite(scaling.pending).all()
    assert torch.isnan(model[0].weight.grad).any() or torch.isinf(model[0].weight.grad).any()  # GradScaler sees it


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_empty_batch_passes_through(recipe: str) -> None:
    model = fp8_model(recipe, 32, 32)
    x = torch.randn(0, 32, requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert out.shape == (0, 32) and x.grad.shape == (0, 32)  # type: ignore[union-attr]
    if recipe == "delayed":
        assert not model[0].fp8.pending.any()
