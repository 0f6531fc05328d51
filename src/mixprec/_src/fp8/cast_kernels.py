"""The Triton kernels of the fused fp8 cast (``fp8/fused_cast.py`` says what they compute and when they run).

Imported only where Triton is; Triton compiles a kernel from its module's globals, so they live here, at the top
level. The rounding is integer arithmetic on the fp32 bits, the same on a GPU and in Triton's interpreter.
"""

# ruff: noqa: N803  (Triton's compile-time constants are named in capitals, as its own kernels name them)

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["amax_tiles", "cast_tiles", "delayed_scale"]


@triton.jit
def _larger(a, b):  # type: ignore[no-untyped-def]
    return tl.maximum(a, b)


@triton.jit  # type: ignore[untyped-decorator]
def amax_tiles(x, tiles, rows, cols, s0, s1, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.program_id(0)
    j = tl.program_id(1)
    r = i * BLOCK + tl.arange(0, BLOCK)
    c = j * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    v = tl.abs(tl.load(x + r[:, None] * s0 + c[None, :] * s1, mask=inside, other=0.0).to(tl.float32))
    # (tl.reduce with a combine of its own: tl.max is a jit function Triton's interpreter cannot call
    # unless the interpreter was on when Triton was imported)
    nan = tl.reduce(tl.reduce((v != v).to(tl.int32), 1, _larger), 0, _larger)
    top = tl.reduce(tl.reduce(tl.where(v != v, 0.0, v), 1, _larger), 0, _larger)
    tl.store(tiles + i * tl.num_programs(1) + j, tl.where(nan > 0, float("nan"), top))


@triton.jit  # type: ignore[untyped-decorator]
def cast_tiles(  # type: ignore[no-untyped-def]
    x, amax, scale, inverse, out, rows, cols, s0, s1, o0, o1,
    FROM_AMAX: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr, BIAS: tl.constexpr,
    MANTISSA: tl.constexpr, NAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    j = tl.program_id(1)
    if FROM_AMAX:  # every program makes the scale (a few fp64 flops)
        wide = tl.load(amax).to(tl.float64)
        eps = tl.full((), EPS, tl.float64)  # a float constant alone would be fp32
        clamped = tl.where(wide != wide, wide, tl.where(wide < eps, eps, wide))
        factor = ((1.0 / clamped) * FP8_MAX).to(tl.float32)
    else:
        factor = tl.load(scale)
    if (i == 0) & (j == 0):  # the first program stores the scale and its reciprocal (fp64 rounded once more to
        if FROM_AMAX:  # fp32: the correctly rounded fp32 quotient, as ATen's reciprocal)
            tl.store(scale, factor)
        tl.store(inverse, (1.0 / factor.to(tl.float64)).to(tl.float32))
    r = i * BLOCK + tl.arange(0, BLOCK)
    c = j * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    v = tl.load(x + r[:, None] * s0 + c[None, :] * s1, mask=inside, other=0.0).to(tl.float32)
    y = v * factor
    y = tl.where(y != y, y, tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y)))
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    mag = tl.where(nan, 0, mag)
    # Normal in fp8: drop 23 - MANTISSA bits to nearest even; a carry moves into the exponent as it should.
    lsb = (mag >> (23 - MANTISSA)) & 1
    rounded = (mag + ((1 << (22 - MANTISSA)) - 1) + lsb) >> (23 - MANTISSA)
    normal = rounded - ((127 - BIAS) << MANTISSA)
    # Subnormal in fp8 (or zero): the significand shifted to units of the smallest step, to nearest even.
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((151 - BIAS - MANTISSA) - (mag >> 23), 1), 31)
    half = (1 << (shift - 1)) - 1
    small = (significand + half + ((significand >> shift) & 1)) >> shift
    code = tl.where(mag >= ((128 - BIAS) << 23), normal, small)
    code = tl.where(nan, NAN, code) | sign
    tl.store(out + r[:, None] * o0 + c[None, :] * o1, code.to(tl.uint8), mask=inside)


@triton.jit  # type: ignore[untyped-decorator]
def _largest(x, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """The largest of the ``n`` fp32 values at ``x``, NaN where one is NaN (ATen's ``amax``), by one program, ``BLOCK``
    at a time (tl.full for zeros and a while loop: Triton's interpreter can call no jit function of Triton's own, which
    tl.zeros is, and takes no runtime bound in a range under numpy 2)."""
    offs = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), 0.0, tl.float32)
    nan = tl.full((BLOCK,), 0, tl.int32)
    start = 0
    while start < n:
        v = tl.load(x + start + offs, mask=start + offs < n, other=0.0)
        nan = tl.maximum(nan, (v != v).to(tl.int32))
        top = tl.maximum(top, tl.where(v != v, 0.0, v))
        start += BLOCK
    return tl.where(tl.reduce(nan, 0, _larger) > 0, float("nan"), tl.reduce(top, 0, _larger))


@triton.jit  # type: ignore[untyped-decorator]
def delayed_scale(  # type: ignore[no-untyped-def]
    tiles, n, row, length, pending, scale,
    RECORD: tl.constexpr, MOST_RECENT: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: delayed scaling's scale of a tensor (its amax from its tiles' ``amax_tiles``) from the tensor's
    amax history ``row`` (its largest or its newest; the amax now where that is not positive), ``MARGIN`` being
    ``2 ** margin``; with ``RECORD``, the amax now (where finite) into its ``pending`` slot, as a max."""
    now = _largest(tiles, n, BLOCK)
    past = tl.load(row) if MOST_RECENT else _largest(row, length, BLOCK)
    wide = tl.where(past > 0, past, now).to(tl.float64)
    eps = tl.full((), EPS, tl.float64)  # a float constant alone would be fp32
    clamped = tl.where(wide != wide, wide, tl.where(wide < eps, eps, wide))
    tl.store(scale, (((1.0 / clamped) * FP8_MAX) / MARGIN).to(tl.float32))
    if RECORD:
        held = tl.load(pending)
        seen = tl.where((now == now) & (tl.abs(now) != float("inf")), now, 0.0)
        tl.store(pending, tl.where(held != held, held, tl.maximum(held, seen)))
