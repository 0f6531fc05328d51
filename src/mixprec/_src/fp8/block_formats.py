"""Block-scaled formats: MXFP8 (a power-of-two scale every 32 values) and NVFP4 (an e4m3 scale every 16).

MXFP8 (OCP Microscaling): e4m3 or e5m2 elements, a block of 32 consecutive values along the last dim shares
one e8m0 scale (a biased power-of-two exponent in a byte; 255 marks a block holding NaN). Two ways to pick
the exponent, as torchao's ``ScaleCalculationMode``: ``floor`` (the OCP spec: ``floor(log2(amax))`` less the
element format's largest exponent; large values of a block may clamp) and ``rceil`` (cuBLAS's: the power of
two at or above ``amax / max``; nothing clamps, small values lose more).

NVFP4: e2m1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; two a byte, the first in the
low nibble), a block of 16 shares an e4m3 scale ``amax / 6``, itself under an optional fp32 scale for the
tensor (``amax / (448 * 6)``: the block scales then use e4m3's whole range). Blocks may also be 16x16 tiles
(:func:`nvfp4_quantize` with ``tile=True``): a weight and its transpose then quantize to the same values.

Each cast is bitwise torchao's reference (``torchao.prototype.mx_formats``: ``to_mx`` and
``nvfp4_quantize``) on every input, NaN and infinities included; the tests hold it. Casts are
plain tensor arithmetic: they trace into a compiled graph, and nothing here syncs with the device.
"""

from __future__ import annotations

import torch

from mixprec._src.dtypes import NamedEnum

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "MX_BLOCK",
    "NV_BLOCK",
    "ScaleMode",
    "e2m1_codes",
    "e2m1_values",
    "mx_dequantize",
    "mx_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "nvfp4_tensor_scale",
    "pack_nibbles",
    "unpack_nibbles",
]

MX_BLOCK = 32
NV_BLOCK = 16
E2M1_MAX = 6.0
#: e2m1's magnitudes by code (the sign is the code's bit 3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)
_E8M0_BIAS = 127
_E8M0_NAN = 255
_F32_MIN_NORMAL = float(torch.finfo(torch.float32).tiny)
#: the exponent of the largest power of two each element format holds (256 for e4m3, 32768 for e5m2)
_MAX_POW2 = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


class ScaleMode(NamedEnum):
    """How an MX block's power-of-two scale is picked from its amax."""

    FLOOR = "floor"  # the OCP spec's: 2**(floor(log2(amax)) - emax); the block's largest values may clamp
    RCEIL = "rceil"  # cuBLAS's: the power of two at or above amax / max; nothing clamps

    @classmethod
    def _what(cls) -> tuple[str, str]:
        return "MX scale mode", "MX scale modes"


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    if t.shape[-1] % block:
        raise ValueError(f"a block-scaled cast needs the last dim ({t.shape[-1]}) to be a multiple of {block}")
    return t.float().reshape(*t.shape[:-1], t.shape[-1] // block, block)


def mx_quantize(
    t: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn, mode: ScaleMode | str = ScaleMode.RCEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``t`` along its last dim: ``(scales, data)``.

    ``scales`` are the blocks' biased e8m0 exponents as uint8, shape ``t.shape[:-1] + (K / 32,)``;
    ``data`` is ``t`` divided by its block's scale, saturated, in ``elem_dtype`` (``t``'s shape).
    """
    mode = ScaleMode.from_name(mode)
    x = _blocks(t, MX_BLOCK)
    amax = x.abs().amax(-1, keepdim=True)
    limit = float(torch.finfo(elem_dtype).max)
    if mode is ScaleMode.RCEIL:
        descale = amax / limit
        normal = (torch.ceil(torch.log2(descale)).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)
        exponent = torch.where(descale.isnan(), _E8M0_NAN, torch.where(descale.isinf(), 254, normal))
        power = torch.exp2(_E8M0_BIAS - exponent.to(torch.float32))
        reciprocal = torch.where(
            exponent == _E8M0_NAN,
            descale,
            torch.where(exponent == 254, 2.0**-127, torch.where(exponent == 0, 1.0, power)),
        )
        data = (x * reciprocal).clamp(-limit, limit)
    else:
        # floor(log2(amax)) is amax's own exponent field, read from its bits
        floor_log2 = torch.bitwise_right_shift(amax.view(torch.int32), 23).bitwise_and(0xFF) - 127
        unbiased = (floor_log2 - _MAX_POW2[elem_dtype]).clamp(-_E8M0_BIAS, _E8M0_BIAS + 1)
        exponent = torch.where(amax.isnan(), _E8M0_NAN, (unbiased + _E8M0_BIAS).to(torch.uint8))
        scale = torch.bitwise_left_shift(exponent.to(torch.int32), 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
        data = (x / scale).clamp(-limit, limit)
    return exponent.to(torch.uint8).squeeze(-1), data.to(elem_dtype).reshape(t.shape)


def mx_dequantize(scales: torch.Tensor, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values :func:`mx_quantize` stands for, in ``dtype`` (a block whose scale is 255 is NaN)."""
    power = torch.pow(torch.full_like(scales, 2.0, dtype=torch.float32), scales.to(torch.int16) - _E8M0_BIAS)
    power = torch.where(scales != _E8M0_NAN, power, float("nan")).to(dtype)
    x = data.to(dtype).reshape(*data.shape[:-1], data.shape[-1] // MX_BLOCK, MX_BLOCK)
    return (x * power.unsqueeze(-1)).reshape(data.shape)


def e2m1_codes(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values (already within +-6) to e2m1 codes, one a uint8: nearest, ties to the even code.

    With ``noise`` (uniform in [0, 1), ``x``'s shape) the magnitude rounds up with the probability of its
    distance from the value below (stochastic rounding). NaN becomes the code torchao's cast gives it
    (:func:`_nan_code`).
    """
    a = x.abs()
    if noise is None:  # a tie goes down where the lower code is even, up where the upper one is
        code = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    else:
        below = (a >= 0.5).to(torch.uint8) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0) + (a >= 4.0) + (a >= 6.0)
        grid = torch.tensor((*E2M1_VALUES, E2M1_MAX), device=x.device)
        low, high = grid[below.long()], grid[below.long() + 1]
        step = torch.where(high > low, high - low, 1.0)
        code = below + ((noise < (a - low) / step) & (high > low)).to(torch.uint8)
    code = torch.where(a.isnan(), _nan_code(x), code)
    return code + torch.signbit(x).to(torch.uint8) * 8


def _nan_code(x: torch.Tensor) -> torch.Tensor:
    """The code torchao's bit-level cast makes of a NaN: its rounding arithmetic run on the NaN's bits
    (2.0 or 1.5 as the payload falls; the cast has no NaN)."""
    bits = x.view(torch.int32).bitwise_and(0x7FFFFFFF)
    odd = torch.bitwise_right_shift(bits, 22).bitwise_and(1)
    rounded = torch.bitwise_right_shift(bits + ((1 - 127) << 23) + (2**21 - 1) + odd, 22)
    return rounded.bitwise_and(0xFF).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each e2m1 code (uint8, one a byte)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte along the last dim, the first in the low nibble (torchao's layout)."""
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_tensor_scale(t: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of the tensor above its block scales: ``amax / (448 * 6)``."""
    return t.detach().abs().amax().float() / (_E4M3_MAX * E2M1_MAX)


def nvfp4_quantize(
    t: torch.Tensor,
    tensor_scale: torch.Tensor | None = None,
    *,
    tile: bool = False,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of a 2-D ``t`` along its last dim: ``(scales, packed)``.

    ``scales`` are e4m3, one a block (``(M, K / 16)``; with ``tile``, one a 16x16 tile, repeated down its 16
    rows); ``packed`` holds two e2m1 codes a byte (``(M, K / 2)`` uint8). ``tensor_scale``: the fp32 scale
    above the block scales (:func:`nvfp4_tensor_scale`), or none. ``noise``: uniform [0, 1) of ``t``'s shape
    for stochastic rounding of the elements (the scales round to nearest).
    """
    x = _blocks(t, NV_BLOCK)
    amax = x.abs().amax(-1)
    if tile:
        rows = t.shape[0]
        if rows % NV_BLOCK:
            raise ValueError(f"16x16 tiles need the rows ({rows}) to be a multiple of {NV_BLOCK}")
        tiles = amax.reshape(rows // NV_BLOCK, NV_BLOCK, -1).amax(1, keepdim=True)
        amax = tiles.expand(-1, NV_BLOCK, -1).reshape(amax.shape)
    block_scale = amax / E2M1_MAX
    if tensor_scale is None:
        scales = block_scale.clamp(_E4M3_TINY, _E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = x * (1.0 / scales.to(torch.float32)).unsqueeze(-1)
    else:
        scales = (block_scale / tensor_scale).clamp(_E4M3_TINY, _E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = x * ((1.0 / tensor_scale) / scales.to(torch.float32)).unsqueeze(-1)
    scaled = scaled.clamp(-E2M1_MAX, E2M1_MAX).reshape(t.shape)
    return scales, pack_nibbles(e2m1_codes(scaled, noise))


def nvfp4_dequantize(
    scales: torch.Tensor, packed: torch.Tensor, tensor_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values :func:`nvfp4_quantize` stands for."""
    values = e2m1_values(unpack_nibbles(packed))
    block = scales.to(torch.float32) if tensor_scale is None else tensor_scale * scales.to(torch.float32)
    x = values.reshape(*values.shape[:-1], values.shape[-1] // NV_BLOCK, NV_BLOCK)
    return (x * block.unsqueeze(-1)).reshape(values.shape)
