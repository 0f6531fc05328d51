"""MXFP8 and NVFP4 casts: bitwise torchao's reference casts on every input class; 16x16 tiles, stochastic
rounding and the Hadamard transform against what they are defined to be."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec._src.fp8 import block_formats as bf
from mixprec._src.fp8 import block_gemm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _adversarial() -> torch.Tensor:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero block (of either size)
    x[1, 5] = 1e6  # one huge value in a block of small ones
    x[2, :] = 1e-40  # fp32 subnormals
    x[3, 3] = float("nan")
    x[4, 7] = float("inf")
    x[5, 9] = -float("inf")
    x[6, 1] = -0.0
    x[7, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 2)  # e2m1's ties and past its max
    x[8, :] = 448.0 * 2.0 ** torch.arange(-32, 32).float()  # every binade, past e4m3's
    x[9, :] = -x[8, :]
    return x


INPUTS: dict[str, Callable[[], torch.Tensor]] = {
    "random": lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(0)),
    "tiny": lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1e-30,
    "huge": lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 1e30,
    "adversarial": _adversarial,
    "bf16": lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(4)).bfloat16(),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _theirs_mx(x: torch.Tensor, elem: torch.dtype, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales, data = mx_tensor.to_mx(x, elem, 32, ScaleCalculationMode(mode))
    return scales.view(torch.uint8), data, mx_tensor.to_dtype(data, scales, elem, 32, torch.float32)


def _theirs_nv(x: torch.Tensor, scaled: bool) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    tensor_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax()) if scaled else None
    scales, packed = nvfp4_tensor.nvfp4_quantize(x, 16, tensor_scale)
    value = nvfp4_tensor.NVFP4Tensor(packed, scales, 16, torch.float32, tensor_scale).dequantize(torch.float32)
    return scales, packed, tensor_scale, value


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_is_torchaos_to_mx_bit_for_bit(inputs: str, mode: str, elem: torch.dtype) -> None:
    x = INPUTS[inputs]()
    their_scales, their_data, their_values = _theirs_mx(x, elem, mode)
    scales, data = bf.mx_quantize(x, elem, mode)
    assert _same(scales, their_scales) and _same(data, their_data)
    assert _same(bf.mx_dequantize(scales, data), their_values)


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("scaled", [False, True], ids=["block scales only", "with a tensor scale"])
def test_nvfp4_is_torchaos_nvfp4_quantize_bit_for_bit(inputs: str, scaled: bool) -> None:
    x = INPUTS[inputs]()
    their_scales, their_packed, tensor_scale, their_values = _theirs_nv(x, scaled)
    if scaled:  # the same tensor scale, however it is spelled
        assert _same(bf.nvfp4_tensor_scale(x), tensor_scale)
    scales, packed = bf.nvfp4_quantize(x, tensor_scale)
    assert _same(scales, their_scales) and _same(packed, their_packed)
    assert _same(bf.nvfp4_dequantize(scales, packed, tensor_scale), their_values)


_FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(_FLOATS, min_size=64, max_size=64), rows=st.integers(1, 3), mode=st.sampled_from(["floor", "rceil"])
)
def test_any_values_cast_as_torchao_casts_them(values: list[float], rows: int, mode: str) -> None:
    x = torch.tensor(values, dtype=torch.float32).repeat(rows, 1) * torch.arange(1, rows + 1).unsqueeze(1)
    for elem in (E4M3, E5M2):
        their_scales, their_data, _ = _theirs_mx(x, elem, mode)
        scales, data = bf.mx_quantize(x, elem, mode)
        assert _same(scales, their_scales) and _same(data, their_data)
    for scaled in (False, True):
        their_scales, their_packed, tensor_scale, _ = _theirs_nv(x, scaled)
        scales, packed = bf.nvfp4_quantize(x, tensor_scale)
        assert _same(scales, their_scales) and _same(packed, their_packed)


def test_e2m1_rounds_to_nearest_with_ties_to_the_even_code() -> None:
    grid = torch.tensor(bf.E2M1_VALUES)
    assert torch.equal(bf.e2m1_values(bf.e2m1_codes(grid)), grid)  # every value is its own code
    assert torch.equal(bf.e2m1_values(bf.e2m1_codes(-grid[1:])), -grid[1:])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert bf.e2m1_values(bf.e2m1_codes(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert bf.e2m1_codes(torch.tensor([-0.0])).item() == 8  # the sign of zero is kept


def _tiles_reference(w: torch.Tensor) -> torch.Tensor:
    """16x16 tiles the slow way: each tile's amax over its 256 values, then each row's blocks scaled by it."""
    tensor_scale = bf.nvfp4_tensor_scale(w)
    out = torch.empty_like(w)
    for i, j in itertools.product(range(0, w.shape[0], 16), range(0, w.shape[1], 16)):
        tile = w[i : i + 16, j : j + 16]
        scale = (tile.abs().amax() / 6.0 / tensor_scale).clamp(2**-6, 448.0).to(E4M3).float()
        codes = bf.e2m1_codes((tile * ((1.0 / tensor_scale) / scale)).clamp(-6, 6))
        out[i : i + 16, j : j + 16] = bf.e2m1_values(codes) * (tensor_scale * scale)
    return out


def test_tiles_scale_each_16x16_tile_and_a_weight_quantizes_as_its_transpose() -> None:
    w = torch.randn(48, 64) * torch.logspace(-3, 3, 64)  # columns of very different sizes
    tiled = block_gemm.BlockScaling(block_gemm.NV, tile=True)
    ours = block_gemm.fake_quantize(w, tiled)
    assert _same(ours, _tiles_reference(w))
    assert _same(block_gemm.fake_quantize(w.t().contiguous(), tiled), ours.t().contiguous())
    rows = block_gemm.BlockScaling(block_gemm.NV)  # 1x16 blocks: the transpose's blocks are other values
    assert not torch.equal(block_gemm.fake_quantize(w.t().contiguous(), rows), block_gemm.fake_quantize(w, rows).t())


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased() -> None:
    x = torch.tensor([0.1, 0.6, 1.3, 2.2, 3.9, 4.5, 5.9, -0.7, 6.0, 1.5])
    many = x.expand(20000, -1)
    draws = bf.e2m1_values(bf.e2m1_codes(many, torch.rand(many.shape, generator=torch.Generator().manual_seed(0))))
    grid = torch.tensor(bf.E2M1_VALUES)
    below = grid[(x.abs().unsqueeze(1) >= grid).sum(1) - 1] * x.sign()
    above = grid[((x.abs().unsqueeze(1) > grid).sum(1)).clamp(max=7)] * x.sign()
    assert ((draws == below) | (draws == above)).all()
    assert torch.allclose(draws.mean(0), x, atol=0.03)  # 4 standard errors; nearest rounding is off by up to 0.5
    assert torch.equal(draws[:, -2:], x[-2:].expand(20000, 2))  # values on the grid stay


def test_the_hadamard_transform_is_orthonormal_and_leaves_the_product() -> None:
    t = block_gemm.hadamard_matrix(torch.device("cpu"))
    assert torch.allclose(t @ t.T, torch.eye(16), atol=1e-6)
    a, b = torch.randn(8, 40), torch.randn(40, 24)  # 40: padded to 48 inside
    rotated = block_gemm.hadamard(a, 1) @ block_gemm.hadamard(b, 0)
    assert torch.allclose(rotated, a @ b, atol=1e-4)
    assert not torch.allclose(block_gemm.hadamard(a, 1)[:, :40], a, atol=1e-2)
