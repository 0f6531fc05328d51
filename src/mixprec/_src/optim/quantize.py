"""Block-wise quantization of optimizer state: codebooks, blocks, nearest codes, packed 4-bit codes.

A state tensor is flattened and cut into blocks of ``block_size`` values; the last block is
padded with zeros, so every tensor quantizes whatever its size and a block never spans two
tensors. Each block keeps its absolute maximum as its scale (fp32; ``1e-12`` at least, so an
all-zero block stays zero) and each value the index of the nearest entry of a codebook after
dividing by the scale (a tie goes to the larger entry)::

    scale[b] = max(|x[b]|, 1e-12)            code[i] = nearest(codebook, x[i] / scale[b])
    x'[i]    = codebook[code[i]] * scale[b]

The codebooks, and why (the anchors' choices; Dettmers et al. 2021, Li et al. 2023):

* ``dynamic`` (8 bits, signed or unsigned): the dynamic tree of bitsandbytes and torchao's
  ``AdamW8bit``: a decimal exponent then a fraction, from 1e-7 to 1 of the block's maximum, so
  the small values of a block that spans seven orders of magnitude keep a code of their own.
* ``dynamic`` (4 bits, signed, three exponent bits): the first moment at 4 bits, as torchao's
  ``AdamW4bit``.
* ``linear`` (4 bits, unsigned, no zero): the second moment at 4 bits; without a zero entry no
  value is ever stored as zero, which would make ``m / (sqrt(v) + eps)`` blow up (the "zero-point
  problem" of Li et al.).

Nearest codes are torchao's (the largest entry at or below the value, then up where the value is at
least half-way to the next), found without a search: per codebook, the least fp32 value that takes
each next code is computed once, and a value's code is read from a table indexed by its top 16 bits
(:func:`nearest_codes`). The codes are bitwise torchao's, but for one
departure: a positive value of an unsigned state (a second moment) is never stored as zero, it
takes the codebook's smallest positive entry instead. torchao's 8-bit and fp8 formats store a
second moment below half the smallest step as 0, and the next step then divides that parameter's
first moment by ``eps`` alone: in a 2-rank bf16-pure run a weight jumped by 3.1 in one step at a
learning rate of 0.01 (Li et al.'s "zero-point problem", which their 4-bit format avoids by having
no zero). 4-bit codes are packed two to a byte, the first value in the high half.

fp8 state (:func:`quantize_fp8`, torchao's ``AdamWFp8``) has no codebook: a block's values are
divided by ``max(|x[b]|, 1e-12) / 448`` and cast to e4m3 (round to nearest even). Nothing here
syncs with the device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = [
    "BITS",
    "FP8",
    "Quantized",
    "code_lookup",
    "codebook",
    "dequantize",
    "lookup_codes",
    "nearest_codes",
    "quantize",
    "quantize_fp8",
    "table",
]

#: The code widths a state can have.
BITS = (8, 4)
#: The fp8 format of fp8 state (torchao's ``AdamWFp8``).
FP8 = torch.float8_e4m3fn
_EPS = 1e-12


@functools.cache
def _dynamic(signed: bool, exponent_bits: int, total_bits: int) -> tuple[float, ...]:
    """The dynamic tree: per decimal exponent, fraction steps between 0.1 and 1 (bitsandbytes' construction)."""
    values: list[float] = []
    fraction_bits = total_bits - 1  # one bit is the sign, or (unsigned) the indicator of the exponent
    for i in range(exponent_bits):
        steps = 2 ** (i + fraction_bits - exponent_bits + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, steps)
        means = ((bounds[:-1] + bounds[1:]) / 2.0 * 10 ** (-(exponent_bits - 1) + i)).tolist()
        values += means + ([-v for v in means] if signed else [])
    extra = 2 ** (fraction_bits - exponent_bits) - 1  # the entries where every exponent bit is zero
    if extra > 0:
        bounds = torch.linspace(0.1, 1, extra + 1)
        means = ((bounds[:-1] + bounds[1:]) / 2.0 * 10 ** (-(exponent_bits - 1) + exponent_bits - 1)).tolist()
        values += means + ([-v for v in means] if signed else [])
    values += [0.0, 1.0]
    assert len(values) == 2**total_bits, len(values)
    return tuple(sorted(values))


def codebook(bits: int, signed: bool) -> tuple[float, ...]:
    """The codebook of a state of ``bits`` bits, signed (a first moment) or not (a second moment)."""
    if bits == 8:
        return _dynamic(signed, 7, 8)
    if bits == 4:
        return _dynamic(True, 3, 4) if signed else tuple(torch.linspace(0, 1, 17)[1:].tolist())
    raise ValueError(f"optimizer state of {bits} bits: valid widths are {', '.join(map(str, BITS))}")


@dataclasses.dataclass
class Quantized:
    """A quantized state tensor.

    Attributes:
        codes: uint8, one code a value (8 bits) or two (4 bits, packed), the padding included.
        scale: fp32, one per block.
        shape: the state's shape.
        bits: the code width.
        signed: its codebook's sign.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    bits: int
    signed: bool = True

    @property
    def fp8(self) -> bool:
        """Whether the codes are fp8 values (then ``signed`` means nothing: e4m3 has a sign)."""
        return self.codes.dtype == FP8

    @property
    def block_size(self) -> int:
        return self.codes.numel() * (8 // self.bits) // self.scale.numel()

    def nbytes(self) -> int:
        """Bytes held: codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()


def table(bits: int, signed: bool, device: torch.device) -> torch.Tensor:
    """The codebook as an fp32 tensor on ``device``."""
    return torch.tensor(codebook(bits, signed), dtype=torch.float32, device=device)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 keys in the values' order (``-0.0`` and ``0.0`` alike)."""
    raw = x.view(torch.int32).long()
    return torch.where(raw < 0, -(raw + 2**31), raw)


def _from_ordered(key: torch.Tensor) -> torch.Tensor:
    return torch.where(key < 0, -key - 2**31, key).to(torch.int32).view(torch.float32)


def _thresholds(entries: torch.Tensor) -> torch.Tensor:
    """Per pair of neighbouring entries, the least fp32 value that takes the upper one: the nearest code of
    ``x`` is the number of thresholds at or below it. torchao's rule, found by bisection over the fp32 values
    between the two entries (it is monotone in ``x``)."""
    low, high = entries[:-1], entries[1:]

    def up(x: torch.Tensor) -> torch.Tensor:
        return x - low >= (high - low) * 0.5

    below, above = _ordered(low), _ordered(high)  # up() is false at the lower entry, true at the upper
    while bool((above - below > 1).any()):
        middle = (below + above) // 2
        taken = up(_from_ordered(middle))
        wide = above - below > 1
        above = torch.where(wide & taken, middle, above)
        below = torch.where(wide & ~taken, middle, below)
    return _from_ordered(above)


_LAST_ROW = 0x3F800000 >> 16  # the top 16 bits of 1.0, the largest magnitude a block's value divided by its scale has


@functools.cache
def code_lookup(bits: int, signed: bool, device: torch.device) -> torch.Tensor:
    """The table :func:`lookup_codes` reads: per bucket of fp32 values that share their top 16 bits (positive
    buckets, then negative), its lowest value's code and the one threshold inside it, packed in one int32
    (``code << 17 | key``; the threshold's low 16 bits as an order key, ``2**16`` where there is none). The
    codebooks' entries are far wider apart than a bucket, so a bucket never holds two thresholds: a value's
    code is its bucket's, or one more at or above the threshold (one lookup, no search). Buckets start just
    below the smallest threshold's, so the table stays small (27 KiB at 8 bits): a smaller magnitude reads
    the first bucket, which holds no threshold."""
    thresholds = _thresholds(table(bits, signed, torch.device("cpu")))
    first_row = int((thresholds.abs().view(torch.int32) >> 16).min()) - 1
    tops = torch.arange(first_row, _LAST_ROW + 1, dtype=torch.int32) << 16
    lowest, highest = tops.view(torch.float32), (tops + 0xFFFF).view(torch.float32)
    packed = []
    for first, last, flip in ((lowest, highest, 0), (-highest, -lowest, 0xFFFF)):
        base = torch.bucketize(first, thresholds, right=True)
        inside = torch.bucketize(last, thresholds, right=True) - base
        if int(inside.max()) > 1:
            raise AssertionError(f"a bucket holds {int(inside.max())} thresholds of the {bits}-bit codebook")
        found = thresholds[base.clamp(max=thresholds.numel() - 1)].view(torch.int32)
        key = torch.where(inside > 0, (found & 0xFFFF) ^ flip, 0x10000)
        packed.append((base.to(torch.int32) << 17) | key.to(torch.int32))
    return torch.cat(packed).to(device)


def lookup_codes(x: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """The nearest codes of fp32 values in [-1, 1] from :func:`code_lookup`'s table, as int32 (traceable: the
    compiled step calls it too). A negative value's low bits order it backwards, hence the flipped key."""
    rows = lookup.numel() // 2
    raw = x.view(torch.int32)
    negative = (raw < 0).to(torch.int32)
    row = ((raw & 0x7FFFFFFF) >> 16).clamp(min=_LAST_ROW + 1 - rows, max=_LAST_ROW) - (_LAST_ROW + 1 - rows)
    entry = lookup[row + negative * rows]
    key = (raw & 0xFFFF) ^ (negative * 0xFFFF)
    return (entry >> 17) + (key >= (entry & 0x1FFFF)).to(torch.int32)


def nearest_codes(x: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """The index of the nearest codebook entry (torchao's: the largest entry at or below ``x``, then up where
    ``x`` is at least half-way to the next) for each fp32 value of ``x`` in [-1, 1], as int32."""
    return lookup_codes(x, code_lookup(bits, signed, x.device))


def quantize(x: torch.Tensor, bits: int, signed: bool, block_size: int) -> Quantized:
    """``x`` (any float dtype) as block-wise codes of ``bits`` bits; ``block_size`` values share a scale.

    Raises:
        ValueError: an unknown width, or a block size that is not a positive even number.
    """
    first = codebook(bits, signed)[0]  # checks the width
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block_size)
    scale = blocks.abs().amax(dim=1).clamp(min=_EPS)
    scaled = (blocks / scale[:, None]).view(-1)
    codes = nearest_codes(scaled, bits, signed)
    if not signed and first == 0:  # a positive second moment is never stored as zero (see the module's doc)
        codes = torch.where((scaled > 0) & (codes == 0), 1, codes)
    codes = codes.to(torch.uint8)
    if bits == 4:
        codes = (codes[::2] << 4) | codes[1::2]
    return Quantized(codes, scale, x.shape, bits, signed)


def quantize_fp8(x: torch.Tensor, block_size: int, signed: bool = True) -> Quantized:
    """``x`` as e4m3 values, one scale per ``block_size`` of them (the last block padded with zeros);
    unsigned (a second moment), a positive value is never stored as zero."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block_size)
    scale = blocks.abs().amax(dim=1).clamp(min=_EPS) / torch.finfo(FP8).max
    scaled = blocks / scale[:, None]
    codes = scaled.to(FP8).view(-1)
    if not signed:
        smallest = torch.tensor(2.0**-9, dtype=FP8, device=x.device)  # e4m3's smallest positive value
        codes = torch.where((scaled.view(-1) > 0) & (codes.float() == 0), smallest, codes)
    return Quantized(codes, scale, x.shape, 8)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` holds, in ``dtype``, shaped as the state."""
    codes = q.codes
    if q.fp8:
        values = (codes.float().view(q.scale.numel(), -1) * q.scale[:, None]).view(-1)
        return values[: q.shape.numel()].view(q.shape).to(dtype)
    if q.bits == 4:
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    entries = table(q.bits, q.signed, codes.device)
    values = (entries[codes.int()].view(q.scale.numel(), -1) * q.scale[:, None]).view(-1)
    return values[: q.shape.numel()].view(q.shape).to(dtype)
