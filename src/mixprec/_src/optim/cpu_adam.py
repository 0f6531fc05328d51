"""Adam(W)'s step with quantized moments (8-bit, 4-bit, fp8) on the CPU, one block at a time.

inductor compiles :mod:`fused_adam`'s graph into passes over a whole chunk of blocks (the moments
written out in fp32 between them, the code lookups as scalar loads); here each block of 256 (8-bit,
fp8) or 128 (4-bit) values is dequantized, updated, measured, quantized and written while it sits in
the core's L1 cache, by a C++ function compiled once per format and weight and gradient dtype with the
toolchain inductor uses (its cache, its flags for this CPU, OpenMP across the blocks; ATen's vector
types, so a CPU without AVX2 or AVX-512 takes their scalar forms; 4-bit codes unpacked and packed
sixteen bytes at a time with SSE2, which every x86-64 CPU has). The arithmetic is
``adam.adam_step``'s, operation for operation and rounding for rounding (ATen's ``lerp`` is a fused
multiply-add, written as one; nothing else is contracted): the codes and scales are the eager step's
bit for bit, and so are bf16 weights; fp32 weights can differ in the last place, where torch's CPU
``sqrt`` (MKL's) is not correctly rounded. Where the toolchain is missing, :func:`available` is false
and the caller takes another path. Nothing here syncs with a device: CPU tensors only.
"""

from __future__ import annotations

import array
import functools
import importlib.resources
import itertools
from typing import Any

import torch

from mixprec._src.optim import moments
from mixprec._src.optim import quantize as q
from mixprec._src.optim.state_precision import StatePrecision

__all__ = [
    "kernel_source",
    "quantized_values",
    "adam_step",
    "available",
    "bf16_adam_step",
    "bf16_available",
    "bf16_builds",
    "bf16_expected",
    "rounding_mode",
    "square_norm",
    "square_norms",
]


def kernel_source(name: str) -> str:
    """The C++ of ``kernels/<name>`` (a file of the package), its first line (which names it) left out."""
    text = importlib.resources.files("mixprec._src.optim").joinpath("kernels", name).read_text()
    return text.split("\n", 1)[1]


#: how the new weight is written: rounded to nearest, stochastically (bf16-sr), with Kahan's compensation, or (an
#: fp32 weight) as it is with a bf16 copy beside it where the row has one (O2's compute copy, to nearest even as
#: ``copy_``; the kernels' compensation column holds its address, or 0)
NEAREST, STOCHASTIC, KAHAN, COPIED = 0, 1, 2, 3


def rounding_mode(stochastic: bool, compensated: bool, copied: bool = False) -> int:
    """How the kernel writes a weight: with bf16-kahan's compensation, bf16-sr's noise, to nearest with a bf16 copy
    (``copied``: an fp32 weight's O2 copy, passed where the compensation goes), or to nearest."""
    return KAHAN if compensated else STOCHASTIC if stochastic else COPIED if copied else NEAREST


_SOURCE = kernel_source("adam_quantized.cpp")

#: what both kernels share: bit casts, fp32 and bf16 loads and stores, ATen's lerp, bf16-sr's noise, the weight's
#: writes, ATen's vector types
_HELPERS = kernel_source("vector_helpers.h")
_CTYPES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16"}
_failed: set[tuple[Any, ...]] = set()
_built: set[tuple[Any, ...]] = set()  # the kinds :func:`available` and :func:`bf16_builds` saw compile


def quantized_values(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> dict[str, Any]:
    """What the quantized kernel's source (``optim/kernels/adam_quantized.cpp``) is filled with for a format and the
    weight's and gradient's dtypes."""
    bits, block = moments.FORMATS[fmt]
    fp8 = fmt == StatePrecision.FP8
    return {
        "bits": bits,
        "block": block,
        "unsigned_zero": int(not fp8 and q.codebook(bits, False)[0] == 0),
        "fp8": int(fp8),
        "p_type": _CTYPES[p_dtype],
        "g_type": _CTYPES[g_dtype],
        "helpers": _HELPERS,
    }


@functools.cache
def _compiled(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    """The kernel of a format and the weight's and gradient's dtypes (compiled at its first use, then from
    inductor's cache on disk)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = _SOURCE % quantized_values(fmt, p_dtype, g_dtype)
    argtypes = [
        f"{_CTYPES[p_dtype]}*",
        f"const {_CTYPES[g_dtype]}*",
        "c10::BFloat16*",
        "uint8_t*",
        "float*",
        "uint8_t*",
        "float*",
        "const float*",
        "const int32_t*",
        "const float*",
        "const int32_t*",
        "const float*",
    ] + ["int64_t"] * 7
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, extra_flags=("-ffp-contract=off",))


def available(fmt: str, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether this step runs here: a quantized state of a contiguous CPU fp32/bf16 weight and gradient,
    and the kernel compiles (once per process and kind; a failure is remembered). Asked for each weight at
    each step: a kind that compiled is a set lookup."""
    if not (p.is_cpu and grad.is_cpu and p.is_contiguous() and grad.is_contiguous()):
        return False
    key = (fmt, p.dtype, grad.dtype)
    if key in _built:
        return True
    if fmt not in moments.FORMATS or p.dtype not in _CTYPES or grad.dtype not in _CTYPES or key in _failed:
        return False
    try:
        _compiled(*key)
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed.add(key)
        return False
    _built.add(key)
    return True


@functools.cache
def _tables(fmt: str) -> tuple[torch.Tensor, ...]:
    if fmt == StatePrecision.FP8:  # e4m3 codes are their own values: no codebook, no lookup (the kernel reads neither)
        empty = torch.zeros(2)
        return empty, empty.int(), empty, empty.int()
    bits = moments.FORMATS[fmt][0]
    cpu = torch.device("cpu")
    return (
        q.table(bits, True, cpu),
        q.code_lookup(bits, True, cpu),
        q.table(bits, False, cpu),
        q.code_lookup(bits, False, cpu),
    )


_NO_COMP = torch.zeros(1, dtype=torch.bfloat16)


def adam_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    scalars: torch.Tensor,
    decoupled: bool,
    fmt: str,
    rounding: int = NEAREST,
    seed: int = 0,
    comp: torch.Tensor | None = None,
) -> None:
    """One step of ``p`` (in place) and its quantized moments in ``state`` (allocated, ``step`` counted):
    ``scalars`` are ``fused_adam``'s seven (lr, the weight decay as applied, 1 - beta1, 1 - beta2, the bias
    corrections), ``rounding`` how the weight is written (``seed``: bf16-sr's for the weight's first value;
    ``comp``: bf16-kahan's compensation). Call where :func:`available`."""
    m_table, m_lookup, v_table, v_lookup = _tables(fmt)
    kernel = _compiled(fmt, p.dtype, grad.dtype)
    kernel(
        p,
        grad,
        _NO_COMP if comp is None else comp,
        state["exp_avg_codes"],
        state["exp_avg_scale"],
        state["exp_avg_sq_codes"],
        state["exp_avg_sq_scale"],
        m_table,
        m_lookup,
        v_table,
        v_lookup,
        scalars.contiguous(),
        p.numel(),
        state["exp_avg_scale"].numel(),
        m_lookup.numel() // 2,
        v_lookup.numel() // 2,
        int(decoupled),
        rounding,
        seed,
    )


_BF16_SOURCE = kernel_source("adam_bf16.cpp")


@functools.cache
def _bf16_compiled(p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = _BF16_SOURCE % {"p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}
    argtypes = [
        f"{_CTYPES[p_dtype]}*",
        f"const {_CTYPES[g_dtype]}*",
        "c10::BFloat16*",
        "c10::BFloat16*",
        "c10::BFloat16*",
        "const float*",
    ] + ["int64_t"] * 6
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, extra_flags=("-ffp-contract=off",))


def bf16_available(p: torch.Tensor, grad: torch.Tensor, *state: torch.Tensor) -> bool:
    """Whether :func:`bf16_adam_step` runs here: contiguous CPU fp32/bf16 weight and gradient, contiguous bf16
    moments, and the kernel compiles."""
    for t in (p, grad, *state):
        if not (t.is_cpu and t.is_contiguous()):
            return False
    return all(t.dtype == torch.bfloat16 for t in state) and bf16_builds(p.dtype, grad.dtype)


def bf16_expected() -> bool:
    """Whether a bf16-state step on the CPU is expected to take :func:`bf16_adam_step` (no kernel of it failed to
    build in this process); compiles nothing."""
    return not any(key[0] == StatePrecision.BF16 for key in _failed)


def bf16_builds(p_dtype: torch.dtype, g_dtype: torch.dtype) -> bool:
    """Whether :func:`bf16_adam_step`'s kernel for these dtypes compiles here (once per process and kind; a
    failure is remembered)."""
    key = ("bf16", p_dtype, g_dtype)
    if key in _built:
        return True
    if p_dtype not in _CTYPES or g_dtype not in _CTYPES or key in _failed:
        return False
    try:
        _bf16_compiled(p_dtype, g_dtype)
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed.add(key)
        return False
    _built.add(key)
    return True


def bf16_adam_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    scalars: torch.Tensor,
    decoupled: bool,
    seeds: tuple[int, int],
    rounding: int = NEAREST,
    seed: int = 0,
    comp: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step of ``p`` (in place) with its bf16 moments ``m`` and ``v`` (in place), each written with
    stochastic rounding from its seed in ``seeds`` (its first value's); ``scalars``, ``rounding``, ``seed``,
    ``comp``: as :func:`adam_step`'s. Call where :func:`bf16_available`."""
    kernel = _bf16_compiled(p.dtype, grad.dtype)
    kernel(
        p,
        grad,
        _NO_COMP if comp is None else comp,
        m,
        v,
        scalars.contiguous(),
        p.numel(),
        int(decoupled),
        rounding,
        seed,
        seeds[0],
        seeds[1],
    )


_NORM_SOURCE = kernel_source("square_norm.cpp")
_LOW = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}


@functools.cache
def _norm_kernel(dtype: torch.dtype, listed: bool = False) -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    ctype = _LOW[dtype]
    first = "const int64_t*" if listed else f"const {ctype}*"
    return CppPythonBindingsCodeCache.load_pybinding(
        [first, "float*", "int64_t"], _NORM_SOURCE % {"x_type": ctype, "list": int(listed)}
    )


def _norm_builds(dtype: torch.dtype, listed: bool) -> bool:
    if ("norm", dtype, listed) in _failed:
        return False
    try:
        _norm_kernel(dtype, listed)
    except Exception:  # no C++ toolchain
        _failed.add(("norm", dtype, listed))
        return False
    return True


def square_norm(x: torch.Tensor) -> torch.Tensor | None:
    """The fp32 sum of squares of a contiguous bf16 or fp16 CPU tensor, read where it lies (no fp32 copy); ``None``
    where this does not run here (another dtype or device, no toolchain)."""
    if x.dtype not in _LOW or not x.is_cpu or not x.is_contiguous() or not _norm_builds(x.dtype, False):
        return None
    out = torch.empty((), dtype=torch.float32)
    _norm_kernel(x.dtype)(x, out, x.numel())
    return out


def square_norms(xs: list[torch.Tensor]) -> torch.Tensor | None:
    """:func:`square_norm` of each of ``xs`` (contiguous CPU tensors of one low-precision dtype) in one call, bit for
    bit: a 1-D fp32 tensor of their sums of squares in order; ``None`` where this does not run for all of them."""
    dtype = xs[0].dtype
    for x in xs:  # a loop, not all() over a generator: this runs at every step
        if x.dtype is not dtype or not x.is_cpu or not x.is_contiguous():
            return None
    if dtype not in _LOW or not _norm_builds(dtype, True):
        return None
    out = torch.empty(len(xs), dtype=torch.float32)
    _norm_kernel(dtype, True)(rows_table([[x.data_ptr(), x.numel()] for x in xs]), out, len(xs))
    return out


def rows_table(rows: list[list[int]]) -> torch.Tensor:
    """``rows`` (of one length) as an int64 tensor, through an array (about 0.7 of ``torch.tensor``'s time)."""
    return torch.frombuffer(array.array("q", itertools.chain.from_iterable(rows)), dtype=torch.int64).view(
        len(rows), -1
    )
