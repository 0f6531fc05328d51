"""The quantizer of optimizer state: torchao's codebooks and codes bitwise, a plain nearest-entry reference,
blocks that never mix tensors, packed 4-bit codes."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec._src.optim import quantize as q


def _torchao() -> tuple[object, object, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        utils = pytest.importorskip("torchao.optim.quant_utils")
        four = pytest.importorskip("torchao.optim.subclass_4bit")
    return utils, four, None


def _moment(signed: bool, n: int = 8192, seed: int = 0) -> torch.Tensor:
    """Values like an Adam moment: seven orders of magnitude, signed for the first, squares for the second."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.empty(n).uniform_(-12, 0, generator=g))
    return x if signed else x.square()


@pytest.mark.parametrize(("bits", "signed"), [(8, True), (8, False), (4, True), (4, False)])
def test_codebooks_are_torchaos(bits: int, signed: bool) -> None:
    utils, four, _ = _torchao()
    if bits == 8:
        theirs = tuple(utils.create_dynamic_map(signed=signed))  # type: ignore[attr-defined]
    else:
        theirs = four.get_qmap_signed() if signed else four.get_qmap_unsigned()  # type: ignore[attr-defined]
    assert q.codebook(bits, signed) == tuple(theirs)
    assert len(q.codebook(bits, signed)) == 2**bits
    assert (0.0 in q.codebook(bits, signed)) == (bits == 8 or signed)  # the 4-bit second moment has no zero


@pytest.mark.parametrize(
    ("bits", "signed", "block"), [(8, True, 256), (8, False, 256), (4, True, 128), (4, False, 128)]
)
def test_codes_and_scales_are_torchaos_bitwise(bits: int, signed: bool, block: int) -> None:
    utils, _, _ = _torchao()
    x = _moment(signed)
    ours = q.quantize(x, bits, signed, block)
    table = torch.tensor(q.codebook(bits, signed))
    scaled, scale = utils.scale_tensor(x, block)  # type: ignore[attr-defined]
    find = utils.quantize_8bit_with_qmap if bits == 8 else utils.quantize_4bit_with_qmap  # type: ignore[attr-defined]
    codes = find(scaled, table)
    if bits == 4:
        codes = (codes[::2] << 4) | codes[1::2]
    if bits == 8 and not signed:  # the one departure: a positive second moment torchao stores as 0 gets entry 1
        flushed = (scaled > 0) & (codes == 0)
        assert flushed.any()  # this data has such values: the departure is exercised
        codes = torch.where(flushed, 1, codes).to(torch.uint8)
    assert torch.equal(ours.scale, scale) and torch.equal(ours.codes, codes)
    unpacked = codes if bits == 8 else torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    assert torch.equal(q.dequantize(ours), utils.dequant_with_qmap(unpacked, table, scale))  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), block=st.sampled_from([2, 8, 64, 256]), bits=st.sampled_from([8, 4]),
       signed=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_every_value_gets_a_nearest_entry_of_its_own_blocks_scale(n: int, block: int, bits: int, signed: bool,
                                                                  seed: int) -> None:  # fmt: skip
    x = _moment(signed, n, seed)
    got = q.quantize(x, bits, signed, block)
    assert got.scale.numel() == -(-n // block) and got.block_size == block
    restored = q.dequantize(got)
    assert restored.shape == x.shape
    # A plain reference: each block's scale is its own largest magnitude (padding is zeros, never larger) ...
    padded = torch.cat([x, x.new_zeros(-n % block)]).view(-1, block)
    assert torch.equal(got.scale, padded.abs().amax(1).clamp(min=1e-12))
    # ... and each value's entry is a nearest one (in float64, within fp32 rounding of a tie).
    table = torch.tensor(q.codebook(bits, signed), dtype=torch.float64)
    scale = got.scale.double().repeat_interleave(block)[:n]
    distance = (x.double()[:, None] / scale[:, None] - table[None, :]).abs()
    chosen = (restored.double() / scale)[:, None]
    best = distance.min(dim=1).values
    mine = (x.double()[:, None] / scale[:, None] - chosen).abs().squeeze(1)
    assert (mine <= best + 1e-6).all()


def test_a_tensor_of_any_size_is_quantized_in_blocks_that_never_leave_it() -> None:
    small = torch.linspace(1e-3, 2e-3, 5)
    alone = q.quantize(small, 8, True, 256)  # padded to one block of its own
    assert alone.scale.numel() == 1 and alone.codes.numel() == 256
    error_alone = ((q.dequantize(alone) - small).abs() / small).max()
    # in one block with values a million times larger, it would get the coarse bottom of the codebook: the
    # reason a block never holds two tensors
    shared = q.dequantize(q.quantize(torch.cat([small, torch.full((251,), 1e3)]), 8, True, 256))[:5]
    error_shared = ((shared - small).abs() / small).max()
    assert error_alone < 0.01 < error_shared


def test_all_zero_blocks_stay_zero_and_a_positive_second_moment_is_never_stored_as_zero() -> None:
    zeros = q.dequantize(q.quantize(torch.zeros(64), 8, False, 32))
    assert torch.equal(zeros, torch.zeros(64))
    tiny = torch.tensor([1.0] + [1e-9] * 31 + [0.0])
    for stored in (q.quantize(tiny, 8, False, 34), q.quantize_fp8(tiny, 34, False)):
        values = q.dequantize(stored)
        assert (values[:32] > 0).all() and values[32] == 0  # positive stays positive; zero stays zero
    assert (q.dequantize(q.quantize(tiny, 4, False, 34)) > 0).all()  # no zero entry at all (torchao's 4-bit)
    assert (q.dequantize(q.quantize(-tiny, 8, True, 34))[1:] == 0).all()  # a first moment may flush: harmless
    assert (q.dequantize(q.quantize_fp8(tiny, 34))[1:] == 0).all()


def test_sizes_and_refusals() -> None:
    x = torch.randn(1000)
    assert q.quantize(x, 8, True, 256).nbytes() == 1024 + 4 * 4
    assert q.quantize(x, 4, True, 128).nbytes() == 512 + 8 * 4
    with pytest.raises(ValueError, match="valid widths are 8, 4"):
        q.quantize(x, 6, True, 256)
    with pytest.raises(ValueError, match="positive even number"):
        q.quantize(x, 8, True, 7)
