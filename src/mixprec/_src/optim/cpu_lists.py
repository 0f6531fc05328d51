"""Adam(W) steps on the CPU for every weight of a param group in one call: bf16-sr's and bf16-kahan's, and those
with quantized or bf16 moments.

``prepare``'s bf16-sr and bf16-kahan levels step each bf16 weight with a compiled fused kernel
(``step.sr_kernel.adam_sr_update``, ``step.kahan.adam_kahan_update``): one call a parameter, each with
its Python overhead and its own small tensors (views, a seed). Here one C++ call steps a whole list: a table of
the tensors' addresses, sizes and seeds, split into chunks of 4096 values that OpenMP shares out across the
list (a small tensor is not a thread's whole turn), each chunk read and written once. The arithmetic is the
compiled kernels', operation for operation and rounding for rounding (fp32 on bf16 storage; no contraction,
as inductor compiles; IEEE division and square root in both): weights, moments and compensations come out
bitwise equal to theirs (tests/optim/test_cpu_lists.py). The rounding of the weight is ``cpu_adam``'s
(bf16-sr's noise at each flat position, or Kahan's compensated write). Compiled once per process with the
toolchain inductor uses; where it is missing, :func:`available` is false and the per-tensor kernels run.

:func:`quantized_step` and :func:`bf16_state_step` do the same for ``cpu_adam``'s kernels (quantized moments, bf16
moments): its per-tensor kernel, compiled unchanged beside a loop over a table of rows, so every weight steps
bitwise as ``cpu_adam`` steps it alone. :func:`write_counts` sets the step counts of a list (``step.host_counts``)
in one call. Nothing here syncs with a device: CPU tensors only.
"""

from __future__ import annotations

import array
import functools
import itertools
from typing import Any

import torch

from mixprec._src.optim import cpu_adam, moments
from mixprec._src.optim.cpu_adam import _BF16_SOURCE, _CTYPES, _HELPERS, KAHAN, NEAREST, STOCHASTIC
from mixprec._src.optim.cpu_adam import _SOURCE as _QUANTIZED_SOURCE

__all__ = [
    "KAHAN",
    "NEAREST",
    "STOCHASTIC",
    "adam_step",
    "available",
    "bf16_state_step",
    "counts_build",
    "lists_build",
    "quantized_step",
    "takes",
    "write_counts",
]

#: what the chunked list kernels share: the includes, bf16-sr's constants, cpu_adam's helpers, and the loop that
#: shares every tensor's chunks of CHUNK values out across the cores (a small tensor is not a thread's whole turn)
_PRELUDE = cpu_adam.kernel_source("lists_prelude.h")

_SOURCE = _PRELUDE + cpu_adam.kernel_source("adam_lists.cpp")
_failed: set[tuple[Any, ...]] = set()  # the kernels that did not build in this process


def _load(argtypes: list[str], source: str) -> Any:
    """``source``'s ``kernel`` built with inductor's toolchain for this CPU (from its cache on disk after the first
    time), as cpu_adam's kernels are: no floating-point contraction."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, extra_flags=("-ffp-contract=off",))


def _builds(key: tuple[Any, ...], build: Any, *args: Any) -> bool:
    """Whether ``build(*args)`` builds its kernel here (once per process and ``key``; a failure is remembered)."""
    if key in _failed:
        return False
    try:
        build(*args)
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed.add(key)
        return False
    return True


_table = cpu_adam.rows_table


class Table:
    """A kernel's table of addresses and sizes (``rows``, of one length) kept from step to step in an array (host
    memory), whose columns the host rewrites in place (:meth:`set_column`: no ATen op); :attr:`tensor` is a tensor
    over it, made at each call (as a table made anew at each step is, and no more)."""

    __slots__ = ("held", "rows", "width")

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows, self.width = len(rows), len(rows[0])
        self.held = array.array("q", itertools.chain.from_iterable(rows))

    @property
    def tensor(self) -> torch.Tensor:
        """The table as an int64 tensor over the array (``rows`` by ``width``)."""
        return torch.frombuffer(self.held, dtype=torch.int64).view(self.rows, self.width)

    def set_column(self, column: int, values: list[int]) -> None:
        """Write ``values`` (one a row) into ``column``."""
        self.held[column :: self.width] = array.array("q", values)


@functools.cache
def _compiled() -> Any:
    return _load(["const int64_t*", "int64_t", "const float*", "int64_t"], _SOURCE % {"helpers": _HELPERS})


def available() -> bool:
    """Whether the kernel runs here (compiled at the first call, once per process; a failure is remembered)."""
    return _builds(("adam",), _compiled)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether a weight's tensors (weight, gradient, moments, compensation) go in the kernel's list: contiguous bf16
    CPU tensors."""
    for t in tensors:  # a loop, not all() over a generator: this runs for every weight at every step  # noqa: SIM110
        if t.dtype is not torch.bfloat16 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def adam_step(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
    scalars: torch.Tensor,
    rounding: int,
) -> None:
    """Step every ``(weight, gradient, exp_avg, exp_avg_sq, compensation, seed)`` of ``rows`` in place, in one call;
    ``scalars``: ``sr_kernel.adam_scalars``' nine (one step count for the whole list), ``rounding``: :data:`STOCHASTIC`
    (each weight's ``seed``) or :data:`KAHAN` (each its ``compensation``). Call where :func:`available` and every
    row's tensors are :func:`takes`."""
    table = _table(
        [
            [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if c is None else c.data_ptr(), p.numel(), seed]
            for p, g, m, v, c, seed in rows
        ]
    )
    _compiled()(table, len(rows), scalars.contiguous(), rounding)


# cpu_adam's per-tensor kernels, each compiled unchanged (renamed) beside a loop over a table of rows
_QUANTIZED_LIST = cpu_adam.kernel_source("adam_quantized_list.cpp")
_BF16_LIST = cpu_adam.kernel_source("adam_bf16_list.cpp")
_ONE = 'extern "C" void kernel('


@functools.cache
def _quantized(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = cpu_adam.quantized_values(fmt, p_dtype, g_dtype)
    source = (_QUANTIZED_SOURCE % values).replace(_ONE, "static void one_tensor(") + _QUANTIZED_LIST % values
    return _load(
        [
            "const int64_t*",
            "int64_t",
            "const float*",
            "const int32_t*",
            "const float*",
            "const int32_t*",
            "const float*",
        ]
        + ["int64_t"] * 4,
        source,
    )


@functools.cache
def _bf16_state(p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = {"p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}
    source = (_BF16_SOURCE % values).replace(_ONE, "static void one_tensor(") + _BF16_LIST % values
    return _load(["const int64_t*", "int64_t", "const float*"] + ["int64_t"] * 5, source)


def lists_build(kind: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> bool:
    """Whether the list kernel of ``kind`` (a quantized format, or ``"bf16"`` moments) builds here for these dtypes
    (once per process; a failure is remembered)."""
    if p_dtype not in _CTYPES or g_dtype not in _CTYPES:
        return False
    if kind == moments.BF16:
        return _builds((kind, p_dtype, g_dtype), _bf16_state, p_dtype, g_dtype)
    return _builds((kind, p_dtype, g_dtype), _quantized, kind, p_dtype, g_dtype)


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def quantized_step(
    fmt: str, rows: list[tuple[Any, ...]], scalars: torch.Tensor, decoupled: bool, rounding: int
) -> None:
    """``cpu_adam.adam_step`` of every ``(weight, gradient, state, compensation or None, seed)`` of ``rows`` (one
    step count, weight and gradient dtypes alike; moments already quantized), in one call. Call where
    :func:`lists_build` and ``cpu_adam.available`` for each row."""
    p0, g0 = rows[0][0], rows[0][1]
    kernel = _quantized(fmt, p0.dtype, g0.dtype)
    m_table, m_lookup, v_table, v_lookup = cpu_adam._tables(fmt)
    table = _table(
        [
            [
                p.data_ptr(),
                g.data_ptr(),
                _pointer(c),
                st["exp_avg_codes"].data_ptr(),
                st["exp_avg_scale"].data_ptr(),
                st["exp_avg_sq_codes"].data_ptr(),
                st["exp_avg_sq_scale"].data_ptr(),
                p.numel(),
                st["exp_avg_scale"].numel(),
                seed,
            ]
            for p, g, st, c, seed in rows
        ]
    )
    kernel(
        table,
        len(rows),
        m_table,
        m_lookup,
        v_table,
        v_lookup,
        scalars.contiguous(),
        m_lookup.numel() // 2,
        v_lookup.numel() // 2,
        int(decoupled),
        rounding,
    )


def bf16_state_step(
    rows: list[tuple[Any, ...]],
    scalars: torch.Tensor,
    decoupled: bool,
    rounding: int,
    keys: tuple[int, int],
    count: int,
) -> None:
    """``cpu_adam.bf16_adam_step`` of every ``(weight, gradient, exp_avg, exp_avg_sq, compensation or None, seed,
    position, shard kind, shard offset)`` of ``rows`` (one step count ``count``, weight and gradient dtypes alike),
    in one call; each moment's seed made in the kernel from its ``keys`` (``bf16_state.moment_key``), the count and
    the row's position and shard (``bf16_state.moment_seed``'s arithmetic). Call where :func:`lists_build` and
    ``cpu_adam.bf16_available`` for each row."""
    kernel = _bf16_state(rows[0][0].dtype, rows[0][1].dtype)
    table = _table(
        [
            [p.data_ptr(), g.data_ptr(), _pointer(c), m.data_ptr(), v.data_ptr(), p.numel(), seed, at, kind, offset]
            for p, g, m, v, c, seed, at, kind, offset in rows
        ]
    )
    kernel(table, len(rows), scalars.contiguous(), int(decoupled), rounding, keys[0], keys[1], count)


@functools.cache
def _counts() -> Any:
    return _load(
        ["const int64_t*", "const float*", "int64_t"],
        _PRELUDE % {"helpers": ""} + cpu_adam.kernel_source("step_counts.cpp"),
    )


def counts_build() -> bool:
    """Whether :func:`write_counts`' kernel builds here (once per process; a failure is remembered)."""
    return _builds(("counts",), _counts)


def write_counts(steps: list[torch.Tensor], values: list[float]) -> None:
    """Set each fp32 CPU scalar of ``steps`` to the value at its place in ``values`` (each an fp32 value), in one
    call (ATen adds to 0-dim tensors one at a time, about a microsecond each); their version counters moved, as an
    in-place add moves them. Call where :func:`counts_build`."""
    addresses = array.array("q", [t.data_ptr() for t in steps])  # through an array: half torch.tensor's time
    held = array.array("f", values)
    _counts()(torch.frombuffer(addresses, dtype=torch.int64), torch.frombuffer(held, dtype=torch.float32), len(steps))
    torch.autograd.graph.increment_version(steps)


_SGD_SOURCE = _PRELUDE + cpu_adam.kernel_source("sgd_lists.cpp")
#: the SGD kernel's flags
NESTEROV, MAXIMIZE, MOMENTUM = 1, 2, 4


@functools.cache
def _sgd(storage: str = "BF16") -> Any:
    """SGD's list kernel on bf16 weights (as on their fp32 copies), or on fp32 ones (``storage`` ``"float"``:
    ``aten_lists.sgd_step``)."""
    return _load(
        ["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t"],
        _SGD_SOURCE % {"helpers": _HELPERS, "storage": storage},
    )


def sgd_available() -> bool:
    """Whether :func:`sgd_step` runs here (its kernel compiled once per process; a failure is remembered)."""
    return _builds(("sgd",), _sgd)


def _sgd_scalars(group: dict[str, Any]) -> torch.Tensor:
    """The SGD kernels' scalars: weight decay, momentum, 1 - dampening, -lr (torch hands each to ATen as a double,
    which its fp32 kernels narrow to fp32)."""
    return torch.tensor(
        [float(group["weight_decay"]), float(group["momentum"]), 1.0 - float(group["dampening"]), -float(group["lr"])],
        dtype=torch.float32,
    )


def sgd_step(rows: list[tuple[Any, ...]], group: dict[str, Any], rounding: int, storage: str = "BF16") -> None:
    """torch.optim.SGD's step of every ``(weight, gradient, momentum buffer or None, compensation or None, seed,
    buffer started)`` of ``rows`` (bf16 CPU tensors, contiguous) with ``group``'s options, in one call, as torch's
    for-loop steps fp32 copies of them (bit for bit); the buffers (bf16) written back rounded to nearest, the
    weights with bf16-sr's noise (``rounding`` :data:`STOCHASTIC`, each its ``seed``) or Kahan's compensation.
    ``storage`` ``"float"``: fp32 tensors, as torch's for-loop steps them (``rounding`` :data:`NEAREST`)."""
    momentum = float(group["momentum"])
    flags = NESTEROV * bool(group.get("nesterov")) | MAXIMIZE * bool(group.get("maximize")) | MOMENTUM * (momentum != 0)
    scalars = _sgd_scalars(group)
    table = _table(
        [
            [p.data_ptr(), g.data_ptr(), _pointer(b), _pointer(c), p.numel(), seed, int(started)]
            for p, g, b, c, seed, started in rows
        ]
    )
    _sgd(storage)(table, len(rows), scalars, flags, rounding)


_SGD_BF16_STATE = _PRELUDE + cpu_adam.kernel_source("sgd_bf16_state.cpp")


@functools.cache
def _sgd_bf16_state(p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    source = _SGD_BF16_STATE % {"p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}
    return _load(["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t"], source)


def sgd_bf16_state_builds(p_dtype: torch.dtype, g_dtype: torch.dtype) -> bool:
    """Whether :func:`sgd_bf16_state_step`'s kernel for these dtypes builds here (once; a failure is remembered)."""
    if p_dtype not in _CTYPES or g_dtype not in _CTYPES:
        return False
    return _builds(("sgd-bf16", p_dtype, g_dtype), _sgd_bf16_state, p_dtype, g_dtype)


def sgd_bf16_state_step(rows: list[tuple[Any, ...]], group: dict[str, Any], rounding: int) -> None:
    """``bf16_state.sgd_step`` of every ``(weight, gradient, momentum buffer, compensation or None, seed, buffer's
    seed, buffer started)`` of ``rows`` (weight and gradient dtypes alike; bf16 buffers; contiguous CPU tensors)
    with ``group``'s options, in one call, bit for bit; ``rounding``: the weight's write (:data:`NEAREST` for fp32
    weights)."""
    kernel = _sgd_bf16_state(rows[0][0].dtype, rows[0][1].dtype)
    scalars = _sgd_scalars(group)
    table = _table(
        [
            [p.data_ptr(), g.data_ptr(), b.data_ptr(), _pointer(c), p.numel(), seed, b_seed, int(started)]
            for p, g, b, c, seed, b_seed, started in rows
        ]
    )
    kernel(table, len(rows), scalars, int(bool(group["nesterov"])), rounding)


# SGD with a quantized momentum buffer: optim.sgd.sgd_step's arithmetic (ATen's add with alpha: one fused
# multiply-add) on cpu_adam's block helpers (the buffer dequantized, updated, measured and quantized a block at a
# time, as moments.load and moments.store do it), appended to cpu_adam's source for its format and dtypes
_SGD_QUANTIZED = cpu_adam.kernel_source("sgd_quantized.cpp")


@functools.cache
def _sgd_quantized(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = cpu_adam.quantized_values(fmt, p_dtype, g_dtype)
    source = (_QUANTIZED_SOURCE % values).replace(_ONE, "static void one_tensor(") + _SGD_QUANTIZED % values
    return _load(
        ["const int64_t*", "int64_t", "const float*", "const int32_t*", "const float*"] + ["int64_t"] * 3, source
    )


def sgd_quantized_builds(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> bool:
    """Whether :func:`sgd_quantized_step`'s kernel builds here for this format and these dtypes (once; a failure is
    remembered)."""
    if fmt not in moments.FORMATS or p_dtype not in _CTYPES or g_dtype not in _CTYPES:
        return False
    return _builds(("sgd", fmt, p_dtype, g_dtype), _sgd_quantized, fmt, p_dtype, g_dtype)


def sgd_quantized_step(fmt: str, rows: list[tuple[Any, ...]], group: dict[str, Any], rounding: int) -> None:
    """``optim.sgd.sgd_step`` of every ``(weight, gradient, state, compensation or None, seed, buffer started)`` of
    ``rows`` (the buffer's codes and scales in ``state``; weight and gradient dtypes alike; contiguous CPU tensors)
    with ``group``'s options, in one call, bit for bit."""
    kernel = _sgd_quantized(fmt, rows[0][0].dtype, rows[0][1].dtype)
    signed_table, signed_lookup, _, _ = cpu_adam._tables(fmt)
    scalars = _sgd_scalars(group)
    table = _table(
        [
            [
                p.data_ptr(),
                g.data_ptr(),
                _pointer(c),
                st["momentum_buffer_codes"].data_ptr(),
                st["momentum_buffer_scale"].data_ptr(),
                p.numel(),
                st["momentum_buffer_scale"].numel(),
                seed,
                int(started),
            ]
            for p, g, st, c, seed, started in rows
        ]
    )
    kernel(
        table,
        len(rows),
        signed_table,
        signed_lookup,
        scalars,
        signed_lookup.numel() // 2,
        int(bool(group["nesterov"])),
        rounding,
    )
