"""The fused tensorwise fp8 cast (``fp8/fused_cast.py``): its Triton kernels, run by Triton's interpreter on CPU
tensors (the same integer rounding as on a GPU), bit for bit against the ATen ops they replace; an fp8 linear's
forward, backward and cast statistics the same either way; the cases it leaves to the ATen ops."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mixprec
from helpers import bitwise_equal, load_script, requires_cuda
from mixprec._src.fp8 import conversion as fp8_conversion
from mixprec._src.fp8 import fused_cast
from mixprec._src.fp8 import gemm as fp8_gemm

triton = pytest.importorskip("triton")
pytestmark = [  # numpy's warnings inside the interpreter: inf * 0, 1 / 0 (IEEE's NaN and inf, as on the GPU)
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [e4m3, e5m2]


@pytest.fixture(scope="module")
def built() -> fused_cast.Kernels:
    return fused_cast.build(interpret=True, block=16)  # small tiles: several a tensor, few programs to interpret


@pytest.fixture
def interpreted(built: fused_cast.Kernels, monkeypatch: pytest.MonkeyPatch) -> fused_cast.Kernels:
    """The kernels as Triton's interpreter runs them (numpy, on CPU tensors): it needs its switch on as they run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return built


def aten(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What ``fp8/gemm.py`` computes for a tensorwise operand without the kernels."""
    amax = t.abs().amax().float()
    scale = scale if scale is not None else fp8_gemm.scale_from_amax(amax, dtype, power_of_two=False)
    return fp8_gemm.quantize(t, scale, dtype), amax, scale


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def same_number(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, or both NaN (an amax's NaN payload is ATen's reduction's own: fp16's differs from fp32's)."""
    return bitwise_equal(a, b) or bool(a.isnan().all() and b.isnan().all() and a.shape == b.shape)


def every_code_and_tie(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, every midpoint between neighbours (a tie), the fp32 values either side of
    each midpoint, values past the format's max, fp32 subnormals, signed zeros, infinities and NaN: as fp32."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()  # sorted, -max .. max
    ties = (values[:-1] + values[1:]) / 2  # exact in fp32
    around = torch.cat([torch.nextafter(ties, ties - 1), torch.nextafter(ties, ties + 1)])
    top = float(torch.finfo(dtype).max)
    extra = torch.tensor([top * 1.01, -top * 1.5, 1e-45, -1e-40, 0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    every = torch.cat([values, ties, around, extra])
    return torch.cat([every, every.new_zeros(-every.numel() % 32)]).reshape(-1, 32)


def operands(source: torch.dtype, interpreted: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors spanning 16 decades (subnormal fp8 codes, flushes), odd shapes, a transposed view, specials."""
    torch.manual_seed(0)
    for shape in ((20, 40), (1, 5)):
        t = (torch.randn(shape) * torch.logspace(-12, 4, shape[1])).to(source)
        t.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30]).to(source)
        yield f"{shape}", t
        yield f"{shape} transposed", t.t()
    yield "zeros", torch.zeros(3, 7, dtype=source)
    # fp32-subnormal values, which a kernel flushing them to zero would get wrong (in bf16 too on a GPU: Triton's
    # interpreter converts a subnormal bf16 wrongly itself)
    if source is torch.float32 or not interpreted:
        yield "subnormal", torch.tensor([[1e-39, -3e-40, 0.0], [2e-41, 5e-39, -1e-38]]).to(source)
    yield "inf", torch.tensor([[3.0, float("inf")], [-float("inf"), 1e-3]], dtype=source)
    yield "nan", torch.tensor([[float("nan"), 1.0], [2.0, -4.0]], dtype=source)


@pytest.mark.parametrize(
    ("dtype", "source"),
    [
        (e4m3, torch.bfloat16),
        (e4m3, torch.float32),
        (e4m3, torch.float16),
        (e5m2, torch.bfloat16),
        (e5m2, torch.float32),
    ],
)
def test_the_cast_is_atens_bit_for_bit(
    interpreted: fused_cast.Kernels, dtype: torch.dtype, source: torch.dtype
) -> None:
    for name, t in operands(source):
        want_q, want_amax, want_scale = aten(t, dtype)
        for column_major in (False, True):
            q, amax, scale, inverse = fused_cast.cast(
                t, dtype, column_major=column_major, eps=fp8_gemm.EPS, kernels=interpreted
            )
            assert bitwise_equal(codes(q), codes(want_q)), (name, column_major)
            assert same_number(amax, want_amax) and same_number(scale, want_scale), (name, amax, scale)
            assert same_number(inverse, want_scale.reciprocal()), (name, inverse)
            rows, cols = t.shape
            assert q.stride() == ((1, rows) if column_major else (cols, 1)), name


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_code_and_every_tie_rounds_as_aten(interpreted: fused_cast.Kernels, dtype: torch.dtype) -> None:
    """With a scale of one, the kernel's integer rounding meets every fp8 value, tie and saturation as ATen's."""
    t = every_code_and_tie(dtype)
    one = torch.ones(())
    q, amax, scale, inverse = fused_cast.cast(t, dtype, one, eps=fp8_gemm.EPS, kernels=interpreted)
    assert amax is None and scale is one and inverse == 1
    assert bitwise_equal(codes(q), codes(aten(t, dtype, one)[0]))


def test_the_amax_is_atens(interpreted: fused_cast.Kernels) -> None:
    """Delayed scaling's record: the amax alone, as ``abs().amax().float()``, for every operand (NaN, inf, zeros)."""
    for source in (torch.bfloat16, torch.float32):
        for name, t in operands(source):
            assert same_number(fused_cast.amax(t, kernels=interpreted), t.abs().amax().float()), name


def test_a_given_scale_is_used_as_it_is(interpreted: fused_cast.Kernels) -> None:
    """Delayed scaling's scale: the cast multiplies by it (no amax is taken), and only by it."""
    t = torch.randn(33, 17) * 300
    for given in (torch.tensor(3.3), torch.tensor([0.0078125]), torch.tensor(0.0)):
        q, amax, _, inverse = fused_cast.cast(
            t, torch.float8_e4m3fn, given, column_major=True, eps=1e-12, kernels=interpreted
        )
        assert amax is None and bitwise_equal(inverse, given.reciprocal().reshape(()))
        assert bitwise_equal(codes(q), codes(aten(t, torch.float8_e4m3fn, given)[0]))


@pytest.fixture
def fused_on_cpu(interpreted: fused_cast.Kernels, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``fp8/gemm.py`` and ``fp8/linear.py`` send CPU operands to the interpreted kernels as they send CUDA ones;
    what they called, in order."""
    called: list[str] = []
    cast, amax, delayed_scale = fused_cast.cast, fused_cast.amax, fused_cast.delayed_scale

    def counted_cast(*args: Any, **kwargs: Any) -> Any:
        given = args[2] if len(args) > 2 else kwargs.get("scale")
        called.append("cast" if given is None else "cast with a scale")
        return cast(*args, **kwargs)

    def counted_amax(*args: Any, **kwargs: Any) -> Any:
        called.append("amax")
        return amax(*args, **kwargs)

    def counted_delayed_scale(*args: Any, **kwargs: Any) -> Any:
        called.append("delayed scale")
        return delayed_scale(*args, **kwargs)

    monkeypatch.setattr(fused_cast, "usable", lambda t, *rest, **kw: t.dim() == 2 and fused_cast.eligible(*rest, **kw))
    monkeypatch.setattr(fused_cast, "_kernels", lambda: interpreted)
    monkeypatch.setattr(fused_cast, "cast", counted_cast)
    monkeypatch.setattr(fused_cast, "amax", counted_amax)
    monkeypatch.setattr(fused_cast, "delayed_scale", counted_delayed_scale)
    return called


def _linear(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16))
    fp8_conversion.convert(model, mixprec.Fp8Config(recipe, convert_head=True), set())
    return model


def _steps(model: nn.Module, dtype: torch.dtype, device: str = "cpu") -> list[Any]:
    """Two forward-backward passes (delayed scaling's history advanced between them), with the casts recorded."""
    seen: list[Any] = []
    for layer in model.modules():
        if hasattr(layer, "fp8"):
            layer.fp8.recording = True
    for step in range(2):
        x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(step)) * 4
        x = x.to(device=device, dtype=dtype).requires_grad_()
        out = model(x)
        out.float().square().sum().backward()
        seen += [out, x.grad, *(p.grad.clone() for p in model.parameters())]  # type: ignore[union-attr]
        seen += [t.clone() for layer in model.modules() if hasattr(layer, "fp8") for t in layer.fp8.buffers()]
        for layer in model.modules():
            if hasattr(layer, "fp8"):
                layer.fp8.advance()
    return seen


@pytest.mark.parametrize(("recipe", "dtype"), [("tensorwise", torch.float32), ("delayed", torch.bfloat16)])
def test_an_fp8_linear_trains_the_same_with_the_fused_cast(
    fused_on_cpu: list[str], recipe: str, dtype: torch.dtype
) -> None:
    """Outputs, gradients, the amax history and the recorded cast statistics, bit for bit; every cast fused (and
    delayed scaling's three scales a layer and step made, and amaxes recorded, by the kernels); the weight gradient's
    cast of the output gradient takes the scale made for its first cast (one read of it for its amax)."""
    model = _linear(recipe).to(dtype)
    reference = copy.deepcopy(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused_cast.ENV, "0")
        want = _steps(reference, dtype)
    assert not fused_on_cpu
    got = _steps(model, dtype)
    delayed = 2 * 2 * 3 if recipe == "delayed" else 0  # two steps, two layers: input, weight, output gradient
    own_scale = 0 if recipe == "delayed" else 2 * 2 * 5  # six operands a layer: the output gradient's second cast
    assert fused_on_cpu.count("cast") == own_scale and fused_on_cpu.count("cast with a scale") == 2 * 2 * 6 - own_scale
    assert fused_on_cpu.count("delayed scale") == delayed and "amax" not in fused_on_cpu
    assert bitwise_equal(got, want)


def _history(kind: str) -> torch.Tensor:
    """A delayed-scaling history (input, weight, output gradient rows of four steps, newest first)."""
    rows = {
        "empty": torch.zeros(3, 4),  # the first step: each tensor scaled by its own amax
        "filled": torch.tensor([[3.0, 5.0, 0.25, 1.0], [1e-3, 2e-3, 0.0, 4e-3], [7.0e5, 1.0, 2.0, 3.0]]),
        "newest zero": torch.tensor([[0.0, 5.0, 9.0, 1.0], [0.0, 0.0, 0.0, 1e-14], [0.0, 1e-30, 2.0, 3.0]]),
    }
    return rows[kind]


_DELAYED_TENSORS = {
    "normal": lambda: torch.randn(20, 16, generator=torch.Generator().manual_seed(3)) * 7,
    "nan": lambda: torch.randn(20, 16).index_put_((torch.tensor([5]), torch.tensor([9])), torch.tensor(float("nan"))),
    "inf": lambda: torch.randn(20, 16).index_put_((torch.tensor([19]), torch.tensor([0])), torch.tensor(float("inf"))),
    "zeros": lambda: torch.zeros(20, 16),
    "tiny": lambda: torch.randn(20, 16, generator=torch.Generator().manual_seed(4)) * 1e-20,
}

# (tensor, history, algo, margin, format, record, source dtype, role): each value of each, and the cases between them
# that choose the scale (a history with a positive amax or not; the amax now NaN, inf, zero or below the clamp)
_DELAYED_CASES = [
    ("normal", "empty", "max", 0, e4m3, True, torch.float32, 0),
    ("normal", "filled", "most_recent", 2, e5m2, True, torch.bfloat16, 2),
    ("nan", "filled", "max", 0, e4m3, True, torch.float32, 1),
    ("nan", "empty", "max", 3, e5m2, False, torch.bfloat16, 0),
    ("inf", "filled", "max", 3, e5m2, True, torch.float32, 2),
    ("inf", "newest zero", "most_recent", 0, e4m3, True, torch.bfloat16, 0),
    ("zeros", "empty", "most_recent", 2, e4m3, True, torch.float32, 1),
    ("tiny", "newest zero", "max", 0, e5m2, True, torch.float32, 1),
    ("tiny", "empty", "max", 0, e4m3, False, torch.bfloat16, 2),
    ("normal", "newest zero", "most_recent", 3, e5m2, False, torch.float32, 1),
]


def _delayed_cases_are_atens(device: str) -> None:
    """Each of ``_DELAYED_CASES`` on ``device``: the scale and the pending record as the kernels make them (where
    they run) and as the ATen ops do, bit for bit."""
    from mixprec._src.fp8 import linear as fp8_linear

    for tensor, history, algo, margin, dtype, record, source, role in _DELAYED_CASES:
        delayed = fp8_linear._Delayed(margin, mixprec.AmaxAlgo(algo), record)
        t = _DELAYED_TENSORS[tensor]().to(device=device, dtype=source)
        pending = torch.tensor([0.5, 0.0, 1e6], device=device)
        got_pending, want_pending = pending.clone(), pending.clone()
        got = fp8_linear._delayed_scale(_history(history).to(device), got_pending, role, t, dtype, delayed, record)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(fused_cast.ENV, "0")
            held = _history(history).to(device)
            want = fp8_linear._delayed_scale(held, want_pending, role, t, dtype, delayed, record)
        assert same_number(got, want) and bitwise_equal(got_pending, want_pending), (tensor, history, got, want)


def test_delayed_scaling_scale_and_record_are_atens_bit_for_bit(fused_on_cpu: list[str]) -> None:
    """Delayed scaling's scale of a tensor (its history's largest or newest amax, its own where that is not
    positive; the margin; the scale's clamp) and its record into the pending amaxes (a max; not where non-finite),
    by the kernels as by the ATen ops: each history, algorithm, margin, format, role and source dtype."""
    _delayed_cases_are_atens("cpu")
    assert fused_on_cpu == ["delayed scale"] * len(_DELAYED_CASES)


def test_a_history_in_another_dtype_stays_with_the_aten_ops(fused_on_cpu: list[str]) -> None:
    """A model's ``.half()`` narrows delayed scaling's history to fp16, which the kernel does not fold: the ATen ops
    make that scale (fp32 and bf16 histories take the kernels, above and in training)."""
    from mixprec._src.fp8 import linear as fp8_linear

    delayed = fp8_linear._Delayed(0, mixprec.AmaxAlgo.MAX, True)
    pending = torch.zeros(3, dtype=torch.float16)
    fp8_linear._delayed_scale(_history("filled").half(), pending, 0, torch.randn(20, 16), e4m3, delayed)
    assert not fused_on_cpu and pending[0] > 0


def test_rowwise_stays_with_the_aten_ops(fused_on_cpu: list[str]) -> None:
    _steps(_linear("rowwise").to(torch.bfloat16), torch.bfloat16)
    assert not fused_on_cpu


def test_what_the_kernels_leave_to_aten() -> None:
    assert fused_cast.eligible(torch.float8_e4m3fn, rowwise=False, power_of_two=False)
    assert not fused_cast.eligible(torch.float8_e4m3fn, rowwise=True, power_of_two=False)
    assert not fused_cast.eligible(torch.float8_e5m2, rowwise=False, power_of_two=True)
    assert not fused_cast.eligible(torch.float8_e4m3fnuz, rowwise=False, power_of_two=False)
    assert not fused_cast.eligible(None, rowwise=False, power_of_two=False)
    with FlopCounterMode(display=False):  # a dispatch mode must see the ops
        assert not fused_cast.eligible(torch.float8_e4m3fn, rowwise=False, power_of_two=False)
    assert not fused_cast.usable(torch.ones(4, 4), torch.float8_e4m3fn, rowwise=False, power_of_two=False)  # CPU


def test_the_fp8_bench_runs_its_aten_cast_rows_with_the_fused_cast_off(
    fused_on_cpu: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench_fp8.py --aten-casts``: the recipe's row runs the fused cast, its "(ATen casts)" row does not, and the
    switch is as it was after each call."""
    bench = load_script("benchmarks/bench_fp8.py")
    monkeypatch.setenv(fused_cast.ENV, "1")
    layer = _linear("tensorwise")[0]
    x = torch.randn(4, 32, requires_grad=True)
    runs = {mode: bench._casts_as_asked(mode, bench._fwd_bwd(layer, layer, x, torch.ones(4, 16)))
            for mode in ("tensorwise", "tensorwise" + bench.ATEN)}  # fmt: skip
    runs["tensorwise" + bench.ATEN]()
    assert not fused_on_cpu and os.environ[fused_cast.ENV] == "1"
    runs["tensorwise"]()
    assert fused_on_cpu.count("cast") == 5 and fused_on_cpu.count("cast with a scale") == 1


@requires_cuda
@pytest.mark.parametrize("dtype", FORMATS)
def test_cuda_kernels_are_atens_bit_for_bit(dtype: torch.dtype) -> None:
    """On the GPU: every code and tie, and spread operands in both layouts, as CUDA's ATen ops compute them."""
    t = every_code_and_tie(dtype).cuda()
    one = torch.ones((), device="cuda")
    q, _, _, _ = fused_cast.cast(t, dtype, one, eps=fp8_gemm.EPS)
    assert bitwise_equal(codes(q), codes(aten(t, dtype, one)[0]))
    for source in (torch.bfloat16, torch.float32):
        for name, cpu in operands(source, interpreted=False):
            t = cpu.cuda()
            want = aten(t, dtype)
            for column_major in (False, True):
                q, amax, scale, inverse = fused_cast.cast(t, dtype, column_major=column_major, eps=fp8_gemm.EPS)
                assert bitwise_equal(codes(q), codes(want[0])), (name, column_major)
                assert same_number(amax, want[1]) and same_number(scale, want[2]), (name, column_major)
                assert same_number(inverse, want[2].reciprocal()), (name, column_major)
            assert same_number(fused_cast.amax(t), want[1]), name


@requires_cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_cuda_fp8_linear_is_the_same_with_and_without_the_fused_cast(recipe: str) -> None:
    model = _linear(recipe).cuda().bfloat16()
    reference = copy.deepcopy(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused_cast.ENV, "0")
        want = _steps(reference, torch.bfloat16, "cuda")
    assert bitwise_equal(_steps(model, torch.bfloat16, "cuda"), want)


@requires_cuda
def test_cuda_delayed_scaling_scale_and_record_are_atens_bit_for_bit() -> None:
    """On the GPU: delayed scaling's scale and record by the kernels as by CUDA's ATen ops, over the same cases."""
    _delayed_cases_are_atens("cuda")


def _compiled_for_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> Any:
    """``kernel`` compiled by Triton's own CUDA compiler for an H100-class GPU (sm_90), offline: no GPU needed. The
    pointers and the other integers are specialized as Triton specializes them at a launch (16-byte aligned and
    multiples of 16; a stride of 1 a constant), so the code is what a launch on those shapes runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


_CAST = {"x": "*bf16", "amax": "*fp32", "scale": "*fp32", "inverse": "*fp32", "out": "*u8", "rows": "i32",
         "cols": "i32", "s0": "i32", "s1": "constexpr", "o0": "i32", "o1": "i32"}  # fmt: skip
_CAST_CONSTANTS = {"FROM_AMAX": True, "EPS": fp8_gemm.EPS, "FP8_MAX": 448.0, "BIAS": 7, "MANTISSA": 3, "NAN": 0x7F,
                   "BLOCK": fused_cast.BLOCK}  # fmt: skip


@pytest.mark.parametrize("column_major", [False, True])
def test_the_cast_compiles_for_a_gpu_to_wide_loads_and_stores(
    column_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row-major bf16 operand is read, and its codes written in either layout, 16 bytes an access (no strided
    access a value: coalesced), through shared memory once where the layout turns; the scale is divided in fp64 to
    nearest (``div.rn.f64``), as the bits need."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = fused_cast.build()
    unit = "o0" if column_major else "o1"  # the output's stride of 1
    signature = {**_CAST, unit: "constexpr", **dict.fromkeys(_CAST_CONSTANTS, "constexpr")}
    compiled = _compiled_for_sm90(kernels.cast_tiles, signature, {"s1": 1, unit: 1, **_CAST_CONSTANTS})
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, "not 16-byte accesses"
    assert ttgir.count("ttg.convert_layout") == int(column_major)
    assert "div.rn.f64" in ptx


@pytest.mark.parametrize("record", [True, False])
@pytest.mark.parametrize("most_recent", [True, False])
def test_the_delayed_scale_compiles_for_a_gpu_in_fp64_to_nearest(
    record: bool, most_recent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    signature = {"tiles": "*fp32", "n": "i32", "row": "*fp32", "length": "i32", "pending": "*fp32", "scale": "*fp32"}
    constants = {"RECORD": record, "MOST_RECENT": most_recent, "EPS": fp8_gemm.EPS, "FP8_MAX": 448.0, "MARGIN": 2.0,
                 "BLOCK": 1024}  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    ptx = _compiled_for_sm90(fused_cast.build().delayed_scale, signature, constants).asm["ptx"]
    assert ptx.count("div.rn.f64") == 2 and "cvt.rn.f32.f64" in ptx  # 1 / amax, / 2**margin; rounded to fp32 once
