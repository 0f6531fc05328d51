"""fp8 GEMMs: scales, saturating casts, CUDA's rules on every device, against a plain reference."""

from __future__ import annotations

import pytest
import torch

from mixprec._src.fp8 import gemm as fp8_gemm
from mixprec._src.fp8.config import E4M3, E5M2, Operand

T4, T5, R4 = Operand(E4M3), Operand(E5M2), Operand(E4M3, rowwise=True)


def reference(a: torch.Tensor, a_op: Operand, b: torch.Tensor, b_op: Operand, out_dtype: torch.dtype,
              power_of_two: bool) -> torch.Tensor:  # fmt: skip
    """Quantize-dequantize written plainly in fp32: scale, cast to fp8 and back, fp32 matmul."""

    def qdq(t: torch.Tensor, op: Operand, dim: int) -> torch.Tensor:
        t = t.float()
        amax = t.abs().amax(dim=dim, keepdim=True) if op.rowwise else t.abs().max()
        scale = (torch.finfo(op.dtype).max / amax.double().clamp(min=1e-12)).float()
        if power_of_two:
            scale = 2.0 ** torch.floor(torch.log2(scale))
        limit = torch.finfo(op.dtype).max
        return (t * scale).clamp(-limit, limit).to(op.dtype).float() * scale.reciprocal()

    product = qdq(a, a_op, 1) @ qdq(b, b_op, 0)
    return product.to(torch.bfloat16).to(out_dtype) if (a_op.rowwise or b_op.rowwise) else product.to(out_dtype)


CASES = {
    "e4m3 x e4m3 tensorwise": (T4, T4, False),
    "e5m2 x e4m3 tensorwise": (T5, T4, False),
    "rowwise x rowwise": (R4, R4, True),
    "rowwise x tensorwise": (R4, T4, True),
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_gemm_equals_quantize_dequantize_reference_bitwise(case: str, out_dtype: torch.dtype) -> None:
    a_op, b_op, power = CASES[case]
    torch.manual_seed(0)
    a, b = torch.randn(24, 48) * 3, torch.randn(48, 32) / 5
    got = fp8_gemm.gemm(a, a_op, b, b_op, out_dtype, power_of_two=power)
    assert got.dtype == out_dtype
    assert torch.equal(got, reference(a, a_op, b, b_op, out_dtype, power))


def test_reduction_dim_is_padded_to_16_without_changing_the_product() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(32, 30), torch.randn(30, 16)  # 30 tokens: the weight gradient's reduction dim
    got = fp8_gemm.gemm(a, T5, b, T4, torch.float32)
    assert torch.equal(got, reference(a, T5, b, T4, torch.float32, False))


def test_high_precision_operand_runs_an_unquantized_gemm() -> None:
    a, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(fp8_gemm.gemm(a, Operand(None), b, Operand(None), torch.bfloat16), a @ b)


def _fp8(rows: int, cols: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.randn(rows, cols).to(dtype)


ONE = torch.tensor(1.0)
REJECTED = {
    "reduction dim 24": lambda: (_fp8(16, 24), _fp8(16, 24).t(), ONE, ONE, torch.float32),
    "output dim 8": lambda: (_fp8(16, 32), _fp8(8, 32).t(), ONE, ONE, torch.float32),
    "e5m2 x e5m2": lambda: (_fp8(16, 32, E5M2), _fp8(16, 32, E5M2).t(), ONE, ONE, torch.float32),
    "row-major second operand": lambda: (_fp8(16, 32), _fp8(32, 16), ONE, ONE, torch.float32),
    "rowwise fp32 output": lambda: (
        _fp8(16, 32),
        _fp8(16, 32).t(),
        torch.ones(16, 1),
        torch.ones(1, 16),
        torch.float32,
    ),
    "tensorwise x rowwise": lambda: (_fp8(16, 32), _fp8(16, 32).t(), ONE, torch.ones(1, 16), torch.bfloat16),
}


@pytest.mark.parametrize("case", REJECTED)
def test_cuda_rules_are_enforced_where_the_cpu_kernel_accepts(case: str) -> None:
    a, b, sa, sb, out = REJECTED[case]()
    if sa.numel() == sb.numel():  # the CPU emulation takes it: the rule is mixprec's, for the GPU's sake
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out)
    with pytest.raises(ValueError, match="CUDA"):
        fp8_gemm.check_cuda_rules(a, b, sa, sb, out)


def test_aligned_gemm_passes_the_rules() -> None:
    fp8_gemm.check_cuda_rules(_fp8(5, 32), _fp8(16, 32).t(), ONE, ONE, torch.float32)  # 5 rows: M is free


def test_scales() -> None:
    amax = torch.tensor([448.0, 1.0, 0.0, 3.0])
    scale = fp8_gemm.scale_from_amax(amax, E4M3, power_of_two=False)
    assert scale.dtype == torch.float32
    assert scale[0] == 1.0 and scale[1] == 448.0
    assert torch.isfinite(scale[2]) and scale[2] == pytest.approx(448.0 / 1e-12, rel=1e-6)  # all-zero: finite
    assert fp8_gemm.scale_from_amax(amax, E4M3, power_of_two=True)[3] == 128.0  # 149.33 down to a power of two
    assert fp8_gemm.scale_from_amax(amax, E4M3, power_of_two=False, margin=2)[1] == 112.0  # 448 / 2**2


def test_quantize_saturates_and_keeps_nan() -> None:
    t = torch.tensor([1000.0, -1e9, float("inf"), float("nan"), 1e-12])
    q = fp8_gemm.quantize(t, torch.tensor(1.0), E4M3).float()
    assert q[:3].tolist() == [448.0, -448.0, 448.0]  # past the max: clamped, never inf
    assert torch.isnan(q[3]) and q[4] == 0.0  # NaN stays NaN (GradScaler sees it); tiny flushes to zero


def test_amax_is_per_row_of_a_and_per_column_of_b() -> None:
    t = torch.tensor([[1.0, -5.0], [2.0, 3.0]])
    assert fp8_gemm.amax_of(t, T4, "a").item() == 5.0
    assert fp8_gemm.amax_of(t, R4, "a").flatten().tolist() == [5.0, 3.0]
    assert fp8_gemm.amax_of(t, R4, "b").flatten().tolist() == [2.0, 5.0]


def test_the_cpu_gemm_runs_atens_emulation_whatever_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX512-FP16 torch sends a tensorwise ``_scaled_mm`` to oneDNN (a scalar loop there, summed in
    another order): mixprec's CPU GEMM turns oneDNN off for the call, and back on after it."""
    seen = []
    real = torch._scaled_mm

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch._C._get_mkldnn_enabled())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch.manual_seed(0)
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    assert torch._C._get_mkldnn_enabled()
    got = fp8_gemm.gemm(a, T4, b, T4, torch.float32)
    assert seen == [False] and torch._C._get_mkldnn_enabled()
    assert torch.equal(got, reference(a, T4, b, T4, torch.float32, False))
    compiled = torch.compile(lambda a, b: fp8_gemm.gemm(a, T4, b, T4, torch.float32), fullgraph=True)
    assert torch.equal(compiled(a, b), got)  # one opaque op in the graph: no break
