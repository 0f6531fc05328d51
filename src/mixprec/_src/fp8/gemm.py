"""fp8 GEMMs as CUDA runs them, on every device: scales, saturating casts, ``torch._scaled_mm``.

An operand is cast as ``q = clamp(t * scale, -max, max).to(fp8)`` with ``scale = max / amax``
(amax of the tensor, or of each row of the GEMM operand over the reduction axis); the GEMM is
``_scaled_mm(a_q, b_q, 1/scale_a, 1/scale_b)``. On a CPU ``_scaled_mm`` is ATen's fp32 emulation
(the operands dequantized, one fp32 matrix product), which accepts shapes and layouts CUDA rejects;
:func:`check_cuda_rules` holds every call to CUDA's rules (dims multiples of 16, no e5m2 x e5m2,
row-major first and column-major second operand, bf16 output for rowwise scales), so what runs here
runs on a GPU. Where the CPU has AVX512-FP16 (Sapphire Rapids and later), torch sends a tensorwise
``_scaled_mm`` to oneDNN instead, whose fp8 matrix product there is a scalar loop (256-cubed: 489 ms,
against 1.8 ms emulated; 2048x1024x2048: 50 s) that also sums in another order than the emulation: the CPU
GEMM here is :func:`cpu_scaled_mm`, the emulation on every CPU (an opaque op that a compiled graph
calls as it is). Nothing here syncs with the device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mixprec._src.fp8 import block_gemm, fused_cast
from mixprec._src.fp8.config import E5M2, Operand

__all__ = [
    "ALIGN",
    "EPS",
    "amax_of",
    "check_cuda_rules",
    "cpu_scaled_mm",
    "fp8_max",
    "gemm",
    "onednn_off",
    "quantize",
    "saturation_threshold",
    "scale_from_amax",
]

#: Smallest amax a scale is made from, as torchao (an all-zero tensor gets a large finite scale).
EPS = 1e-12
#: fp8 GEMMs on CUDA need each dimension of the second operand and the reduction dim a multiple of this.
ALIGN = 16


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def saturation_threshold(dtype: torch.dtype) -> float:
    """Where the clamp starts to matter: past ``max`` plus half a step, round-to-nearest would overflow."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def amax_of(t: torch.Tensor, operand: Operand, side: str) -> torch.Tensor:
    """fp32 amax of a GEMM operand: one value, or one per row of ``a`` / per column of ``b``."""
    if not operand.rowwise:
        return t.abs().amax().float()
    return t.abs().amax(dim=1 if side == "a" else 0, keepdim=True).float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool, margin: int = 0) -> torch.Tensor:
    """``max / amax / 2**margin`` as fp32; the division in fp64 (a large max over a tiny amax stays exact)."""
    scale = (fp8_max(dtype) / amax.double().clamp(min=EPS) / 2.0**margin).float()
    if power_of_two:  # products of scales are then exact, and rowwise rescaling adds no rounding
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``t * scale`` to ``dtype`` (overflow clamps to the format's max, NaN stays NaN)."""
    limit = fp8_max(dtype)
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def check_cuda_rules(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """Raise where CUDA's ``_scaled_mm`` would: checked on every device (shapes only, no sync)."""
    k, n = b.shape
    if a.shape[1] % ALIGN or k % ALIGN or n % ALIGN:
        raise ValueError(
            f"fp8 GEMM {tuple(a.shape)} x {tuple(b.shape)}: CUDA needs the reduction dim and both "
            f"dims of the second operand to be multiples of {ALIGN}"
        )
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("fp8 GEMM e5m2 x e5m2: CUDA has no such kernel; one operand must be e4m3")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError("fp8 GEMM: CUDA needs a row-major first operand and a column-major second one")
    if scale_a.numel() > 1 and out_dtype != torch.bfloat16:
        raise ValueError("fp8 GEMM with rowwise scales: CUDA returns bf16 only")
    if (scale_a.numel() > 1) != (scale_b.numel() > 1):
        raise ValueError("fp8 GEMM: CUDA needs both operands scaled the same way (tensorwise or rowwise)")


def _padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the reduction dim to a multiple of :data:`ALIGN` (zeros change neither amax nor the product)."""
    extra = -a.shape[1] % ALIGN
    if not extra:
        return a, b
    return F.pad(a, (0, extra)), F.pad(b, (0, 0, 0, extra))


def gemm(
    a: torch.Tensor,
    a_op: Operand,
    b: torch.Tensor,
    b_op: Operand,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
    power_of_two: bool = False,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    record: list[Any] | None = None,
    rotate: bool = False,
    seed: torch.Tensor | None = None,
    scales: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``a @ b`` with each operand cast as its :class:`Operand` says (or kept in high precision).

    ``scale_a`` / ``scale_b`` override the scales made from the operands' own amax (delayed
    scaling, or a scale made for the same tensor in another GEMM). ``record`` collects ``(operand, amax, scale,
    dtype)`` of each cast, for statistics (a :class:`~mixprec._src.fp8.block_gemm.BlockRecord` for a block-scaled
    one). ``scales`` collects the two scales the operands were cast with (per-tensor or per-row; nothing for a
    block-scaled or high-precision GEMM). Block-scaled operands go to
    :func:`~mixprec._src.fp8.block_gemm.block_gemm` (emulated), ``rotate`` and ``seed`` with them.
    """
    if a_op.block is not None or b_op.block is not None:
        if record is not None:
            record.extend(block_gemm.BlockRecord(t, op.block) for t, op in ((a, a_op), (b, b_op)) if op.block)
        return block_gemm.block_gemm(a, a_op.block, b, b_op.block, out_dtype, rotate=rotate, seed=seed)
    if a_op.dtype is None or b_op.dtype is None:  # a high-precision GEMM (rowwise_with_gw_hp's weight gradient)
        return torch.mm(a, b.to(a.dtype)).to(out_dtype)
    a, b = _padded(a, b)
    casts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for t, op, side, given in ((a, a_op, "a", scale_a), (b, b_op, "b", scale_b)):
        if fused_cast.usable(t, op.dtype, op.rowwise, power_of_two and given is None):
            # CUDA, eager: the same bits in three launches, written in the GEMM's layout, with the reciprocal
            q, fused_amax, scale, inverse = fused_cast.cast(t, op.dtype, given, column_major=side == "b", eps=EPS)  # type: ignore[arg-type]
            if record is not None:
                amax = fused_amax if fused_amax is not None else amax_of(t, op, side)
                record.append((t, amax, scale, op.dtype))
            casts.append((q, scale, inverse))
            continue
        read = amax_of(t, op, side) if given is None or record is not None else None  # a given scale: no read
        scale = given if given is not None else scale_from_amax(read, op.dtype, power_of_two)  # type: ignore[arg-type]
        if record is not None:
            record.append((t, read, scale, op.dtype))  # type: ignore[arg-type]
        casts.append((quantize(t, scale, op.dtype), scale, None))  # type: ignore[arg-type]
    (a_q, sa, inv_a), (b_q, sb, inv_b) = casts
    if scales is not None:
        scales += (sa, sb)
    a_q = a_q.contiguous()
    b_q = b_q.t().contiguous().t()
    rows, cols = a_q.shape[0], b_q.shape[1]
    # One granularity per GEMM: the tensorwise scale, repeated (a real tensor: CUDA takes no stride-0 scales).
    if a_op.rowwise and not b_op.rowwise:
        sb, inv_b = sb.reshape(1, 1).repeat(1, cols), None
    elif b_op.rowwise and not a_op.rowwise:
        sa, inv_a = sa.reshape(1, 1).repeat(rows, 1), None
    rowwise = a_op.rowwise or b_op.rowwise
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    inv_a = sa.reciprocal() if inv_a is None else inv_a
    inv_b = sb.reciprocal() if inv_b is None else inv_b
    check_cuda_rules(a_q, b_q, inv_a, inv_b, gemm_dtype)
    out: torch.Tensor
    if a_q.device.type == "cpu":
        out = cpu_scaled_mm(a_q, b_q, inv_a, inv_b, gemm_dtype, fast_accum)
    else:
        out = torch._scaled_mm(a_q, b_q, scale_a=inv_a, scale_b=inv_b, out_dtype=gemm_dtype, use_fast_accum=fast_accum)
    return out.to(out_dtype)


@torch.library.custom_op("mixprec::cpu_scaled_mm", mutates_args=())
def cpu_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """``torch._scaled_mm`` on the CPU as ATen emulates it, with oneDNN off for the call (see the module)."""
    with onednn_off():
        out: torch.Tensor = torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return out


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """oneDNN off inside (CPU ``_scaled_mm`` then takes ATen's emulation), restored after."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@cpu_scaled_mm.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
