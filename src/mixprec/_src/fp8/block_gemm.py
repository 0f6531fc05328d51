"""Block-scaled GEMMs, emulated: each operand quantized in blocks along the reduction dim, dequantized, one
fp32 matrix product.

An operand's :class:`BlockScaling` says how it is cast: MXFP8 (blocks of 32, e8m0 scales) or NVFP4 (blocks
of 16, e4m3 scales under an fp32 scale for the tensor; optionally 16x16 tiles, stochastic rounding). The
weight-gradient GEMM of the NVFP4 recipe may first rotate both operands by a random 16x16 Hadamard
transform along the reduction dim (:func:`hadamard`): the product is unchanged, outliers are spread over
their block before it is quantized. No GPU here has block-scaled GEMMs, so every device runs this
emulation (dequantize, fp32 GEMM; torchao's emulated path does the same); figures timed on it are labelled
"emulated". Stochastic rounding's noise is a function of a seed tensor and each element's index
(:func:`uniform_noise`): a layer keeps its seed and a counter it advances each backward (``fp8.noise``, a
buffer), so a checkpoint carries the noise to come and a compiled backward draws what the eager one draws.
Nothing here syncs.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch
import torch.nn.functional as F

from mixprec._src.fp8 import block_formats as bf
from mixprec._src.fp8.block_formats import ScaleMode

__all__ = [
    "BlockRecord",
    "BlockScaling",
    "MX",
    "NV",
    "block_gemm",
    "cast_stats",
    "fake_quantize",
    "hadamard",
    "hadamard_matrix",
    "noise_seed",
    "uniform_noise",
]

MX, NV = "mx", "nv"


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """How one GEMM operand is cast in blocks along the reduction dim.

    Attributes:
        format: ``"mx"`` (MXFP8: blocks of 32, e8m0 scales) or ``"nv"`` (NVFP4: blocks of 16, e4m3 scales).
        elem: MXFP8's element dtype (e4m3 or e5m2); NVFP4's is e2m1.
        mode: MXFP8's scale mode (``rceil`` or ``floor``).
        tile: NVFP4: one scale a 16x16 tile (a weight and its transpose quantize alike).
        stochastic: NVFP4: elements round stochastically (gradients), not to nearest.
        tensor_scale: NVFP4: an fp32 scale for the tensor above the block scales.
    """

    format: str
    elem: torch.dtype = torch.float8_e4m3fn
    mode: ScaleMode = ScaleMode.RCEIL
    tile: bool = False
    stochastic: bool = False
    tensor_scale: bool = True

    @property
    def block(self) -> int:
        return bf.MX_BLOCK if self.format == MX else bf.NV_BLOCK


def _pad_to(t: torch.Tensor, multiple: int, dim: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


_WEYL = 0x9E3779B1  # 2**32 / the golden ratio
_MIX = (0x2545F491, 0x85EBCA6B)  # odd multipliers that spread a layer's salt and its counter over 32 bits


def uniform_noise(shape: tuple[int, ...], seed: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) noise, fp32, from an int64 ``seed`` tensor and each element's index: a Weyl sequence, element
    i gets the top 24 bits of ``(i * 0x9E3779B1 + seed) mod 2**32``. With a fresh seed each call every element's
    noise is uniform and independent from call to call (neighbours get evenly spread values: a dither)."""
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=seed.device).reshape(shape)
    bits = (index * _WEYL + seed).bitwise_and(0xFFFFFFFF)
    return torch.bitwise_right_shift(bits, 8).to(torch.float32) * 2.0**-24


def noise_seed(state: torch.Tensor, cast: int) -> torch.Tensor:
    """The seed of one cast from a layer's ``(salt, counter)`` state (int64) and the cast's number in the call."""
    salt, counter = state[0], state[1]
    return (salt * _MIX[0] + counter * _MIX[1] + cast * _WEYL).bitwise_and(0xFFFFFFFF)


def fake_quantize(t: torch.Tensor, scaling: BlockScaling, seed: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (2-D, blocks along its last dim) quantized as ``scaling`` says and dequantized: fp32, ``t``'s shape.

    ``seed``: stochastic rounding's (:func:`uniform_noise`); without one the noise is drawn from torch's generator.
    """
    rows, cols = t.shape
    x = _pad_to(t.float(), scaling.block, 1)
    if scaling.format == MX:
        out = bf.mx_dequantize(*bf.mx_quantize(x, scaling.elem, scaling.mode))
    else:
        if scaling.tile:
            x = _pad_to(x, bf.NV_BLOCK, 0)
        scale = bf.nvfp4_tensor_scale(x) if scaling.tensor_scale else None
        noise = None
        if scaling.stochastic:
            noise = torch.rand_like(x) if seed is None else uniform_noise(tuple(x.shape), seed)
        out = bf.nvfp4_dequantize(*bf.nvfp4_quantize(x, scale, tile=scaling.tile, noise=noise), scale)
    return out[:rows, :cols]


_SIGNS = tuple(random.Random(0).choice((-1.0, 1.0)) for _ in range(bf.NV_BLOCK))
#: the random 16x16 Hadamard transform: Sylvester's matrix (entry i, j is -1 to the popcount of i & j) over 4,
#: each row times a fixed random sign; orthonormal, so rotating both GEMM operands leaves their product
_HADAMARD = tuple(
    tuple(_SIGNS[i] * (-1.0) ** bin(i & j).count("1") / 4.0 for j in range(bf.NV_BLOCK)) for i in range(bf.NV_BLOCK)
)


def hadamard_matrix(device: torch.device) -> torch.Tensor:
    """The random 16x16 Hadamard transform (a constant of a compiled graph)."""
    return torch.tensor(_HADAMARD, device=device)


def hadamard(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` rotated by :func:`hadamard_matrix` in blocks of 16 along ``dim`` (padded with zeros to 16)."""
    x = _pad_to(t.float(), bf.NV_BLOCK, dim).movedim(dim, -1)
    blocks = x.reshape(*x.shape[:-1], -1, bf.NV_BLOCK) @ hadamard_matrix(t.device)
    return blocks.reshape(x.shape).movedim(-1, dim)


def block_gemm(
    a: torch.Tensor,
    a_scaling: BlockScaling | None,
    b: torch.Tensor,
    b_scaling: BlockScaling | None,
    out_dtype: torch.dtype,
    *,
    rotate: bool = False,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` with each operand quantized in blocks along the reduction dim (``None``: kept as it is).

    ``rotate``: both operands first rotated along the reduction dim by the random Hadamard transform. ``seed``:
    stochastic rounding's, for ``a`` (``b`` takes the next one).
    """
    if rotate:
        a, b = hadamard(a, 1), hadamard(b, 0)
    a_q = a.float() if a_scaling is None else fake_quantize(a, a_scaling, seed)
    b_q = b.float() if b_scaling is None else fake_quantize(b.t(), b_scaling, None if seed is None else seed + 1).t()
    return torch.mm(a_q, b_q).to(out_dtype)


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """One block-scaled cast, kept for statistics (:func:`cast_stats` reads it when they are recorded)."""

    tensor: torch.Tensor
    scaling: BlockScaling


def cast_stats(record: BlockRecord) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(amax, scale, saturated, flushed)`` of a block cast: the tensor's amax, the smallest multiplier a block
    got, the share of blocks whose values clipped at the element format's largest value, and the share of
    non-zero values that became zero. Tensors (no sync)."""
    scaling = record.scaling
    with torch.no_grad():
        t = _pad_to(record.tensor.detach().float(), scaling.block, 1)
        blocks = t.reshape(t.shape[0], -1, scaling.block)
        amax = blocks.abs().amax(-1)
        if scaling.format == MX:
            exponents, data = bf.mx_quantize(t, scaling.elem, scaling.mode)
            multiplier = torch.exp2(127 - exponents.float())
            info = torch.finfo(scaling.elem)
            top = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
            deq = bf.mx_dequantize(exponents, data)
        else:
            x = _pad_to(t, bf.NV_BLOCK, 0) if scaling.tile else t
            tensor_scale = bf.nvfp4_tensor_scale(x) if scaling.tensor_scale else None
            scales, packed = bf.nvfp4_quantize(x, tensor_scale, tile=scaling.tile)
            block_scale = scales.float() if tensor_scale is None else tensor_scale * scales.float()
            multiplier, top = 1.0 / block_scale[: t.shape[0]], bf.E2M1_MAX + 1.0  # past 6 and half its step
            deq = bf.nvfp4_dequantize(scales, packed, tensor_scale)[: t.shape[0]]
        saturated = ((amax * multiplier) > top).float().mean()
        flushed = ((t != 0) & (deq == 0)).float().mean()
    return amax.amax(), multiplier.amin(), saturated, flushed
