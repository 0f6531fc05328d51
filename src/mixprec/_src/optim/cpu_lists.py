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
bitwise as ``cpu_adam`` steps it alone. Nothing here syncs with a device: CPU tensors only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mixprec._src.optim import cpu_adam, moments
from mixprec._src.optim import quantize as q
from mixprec._src.optim.cpu_adam import _BF16_SOURCE, _CTYPES, _HELPERS, KAHAN, NEAREST, STOCHASTIC
from mixprec._src.optim.cpu_adam import _SOURCE as _QUANTIZED_SOURCE
from mixprec._src.optim.state_precision import StatePrecision

__all__ = [
    "KAHAN",
    "NEAREST",
    "STOCHASTIC",
    "adam_step",
    "available",
    "bf16_state_step",
    "lists_build",
    "quantized_step",
    "takes",
]

#: what the chunked list kernels share: the includes, bf16-sr's constants, cpu_adam's helpers, and the loop that
#: shares every tensor's chunks of CHUNK values out across the cores (a small tensor is not a thread's whole turn)
_PRELUDE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int32_t WEYL = -1640531535;
constexpr int64_t CHUNK = 4096;
using BF16 = c10::BFloat16;
%(helpers)s

// body(row, first, last) for each chunk [first, last) of each of the n rows of table (width columns, the tensor's
// number of values in column numel_at)
template <typename Body>
inline void over_chunks(const int64_t* table, int64_t n, int64_t width, int64_t numel_at, const Body& body) {
    std::vector<int64_t> starts(n + 1, 0);  // each tensor's first chunk in the list's
    for (int64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + (table[width * i + numel_at] + CHUNK - 1) / CHUNK;
    const int64_t chunks = starts[n];
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = std::upper_bound(starts.begin(), starts.end(), c) - starts.begin() - 1;
        const int64_t* row = table + width * i;
        const int64_t first = (c - starts[i]) * CHUNK;
        body(row, first, std::min(first + CHUNK, row[numel_at]));
    }
}
"""

_SOURCE = (
    _PRELUDE
    + r"""

// sr_kernel.adam_sr_update / kahan.adam_kahan_update on values [first, last) of one tensor: s holds their nine
// scalars (decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, lr / bias correction 1, 1 / sqrt(bias correction 2), eps)
inline void update(BF16* p, const BF16* g, BF16* m, BF16* v, BF16* comp, int64_t first, int64_t last,
                   const float* s, int64_t rounding, int64_t seed) {
    const VecF decay(s[0]), l2(s[1]), beta1(s[2]), omb1(s[3]), beta2(s[4]), omb2(s[5]), step(s[6]), bc2(s[7]);
    const VecF eps(s[8]);
    int64_t k = first;
    // two float vectors from one whole bf16 vector (a converted half-vector load or store costs a round trip)
    using VecB = at::vec::Vectorized<BF16>;
    for (; k + VecB::size() <= last; k += VecB::size()) {
        VecF pw[2], gw[2], mw[2], vw[2], next[2];
        std::tie(pw[0], pw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(p + k));
        std::tie(gw[0], gw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(g + k));
        std::tie(mw[0], mw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(m + k));
        std::tie(vw[0], vw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(v + k));
        for (int h = 0; h < 2; ++h) {
            const VecF gk = gw[h] + l2 * pw[h];
            mw[h] = mw[h] * beta1 + gk * omb1;
            vw[h] = vw[h] * beta2 + omb2 * gk * gk;
            next[h] = pw[h] * decay - step * mw[h] / (vw[h].sqrt() * bc2 + eps);
        }
        at::vec::convert_from_float<BF16>(mw[0], mw[1]).store(m + k);
        at::vec::convert_from_float<BF16>(vw[0], vw[1]).store(v + k);
        if (rounding == 1) {  // the noise leaves 16 low zero bits: the conversion is exact
            at::vec::convert_from_float<BF16>(vec_sr(next[0], k, seed), vec_sr(next[1], k + VecF::size(), seed))
                .store(p + k);
        } else if (rounding == 2) {  // kahan.write: the sum rounded to nearest, what that dropped kept
            VecF sum[2], back[2], cw[2];
            std::tie(cw[0], cw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(comp + k));
            for (int h = 0; h < 2; ++h) sum[h] = pw[h] + ((next[h] - pw[h]) + cw[h]);
            const VecB rounded = at::vec::convert_from_float<BF16>(sum[0], sum[1]);
            rounded.store(p + k);
            std::tie(back[0], back[1]) = at::vec::convert_to_float<BF16>(rounded);
            at::vec::convert_from_float<BF16>(sum[0] - back[0], sum[1] - back[1]).store(comp + k);
        } else {
            at::vec::convert_from_float<BF16>(next[0], next[1]).store(p + k);
        }
    }
    for (; k + VecF::size() <= last; k += VecF::size()) {
        const VecF p32 = load_float(p + k);
        const VecF gk = load_float(g + k) + l2 * p32;
        const VecF mk = load_float(m + k) * beta1 + gk * omb1;
        const VecF vk = load_float(v + k) * beta2 + omb2 * gk * gk;
        const VecF next = p32 * decay - step * mk / (vk.sqrt() * bc2 + eps);
        store_vec(m + k, mk);
        store_vec(v + k, vk);
        write_vec(p, comp, k, next, rounding, seed);
    }
    for (; k < last; ++k) {
        const float p32 = to_float(p[k]);
        const float gk = to_float(g[k]) + s[1] * p32;
        const float mk = to_float(m[k]) * s[2] + gk * s[3];
        const float vk = to_float(v[k]) * s[4] + s[5] * gk * gk;
        const float next = p32 * s[0] - s[6] * mk / (std::sqrt(vk) * s[7] + s[8]);
        store(m + k, mk);
        store(v + k, vk);
        write_one(p, comp, k, next, p32, rounding, seed);
    }
}
}  // namespace

// table: n rows of (weight, gradient, exp_avg, exp_avg_sq, compensation or 0, numel, seed)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t rounding) {
    over_chunks(table, n, 7, 5, [&](const int64_t* row, int64_t first, int64_t last) {
        update(reinterpret_cast<BF16*>(row[0]), reinterpret_cast<const BF16*>(row[1]), reinterpret_cast<BF16*>(row[2]),
               reinterpret_cast<BF16*>(row[3]), reinterpret_cast<BF16*>(row[4]), first, last, s, rounding, row[6]);
    });
}
"""
)
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


def adam_step(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
              scalars: torch.Tensor, rounding: int) -> None:  # fmt: skip
    """Step every ``(weight, gradient, exp_avg, exp_avg_sq, compensation, seed)`` of ``rows`` in place, in one call;
    ``scalars``: ``sr_kernel.adam_scalars``' nine (one step count for the whole list), ``rounding``: :data:`STOCHASTIC`
    (each weight's ``seed``) or :data:`KAHAN` (each its ``compensation``). Call where :func:`available` and every
    row's tensors are :func:`takes`."""
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if c is None else c.data_ptr(),
                           p.numel(), seed] for p, g, m, v, c, seed in rows], dtype=torch.int64)  # fmt: skip
    _compiled()(table, len(rows), scalars.contiguous(), rounding)


# cpu_adam's per-tensor kernels, each compiled unchanged (renamed) beside a loop over a table of rows
_QUANTIZED_LIST = r"""
// table: n rows of (weight, gradient, compensation or 0, exp_avg codes, exp_avg scales, exp_avg_sq codes,
// exp_avg_sq scales, numel, blocks, seed)
extern "C" void kernel(const int64_t* table, int64_t n, const float* m_table, const int32_t* m_lookup,
                       const float* v_table, const int32_t* v_lookup, const float* scalars, int64_t m_rows,
                       int64_t v_rows, int64_t decoupled, int64_t rounding) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* r = table + 10 * i;
        one_tensor(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
                   reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<uint8_t*>(r[3]),
                   reinterpret_cast<float*>(r[4]), reinterpret_cast<uint8_t*>(r[5]), reinterpret_cast<float*>(r[6]),
                   m_table, m_lookup, v_table, v_lookup, scalars, r[7], r[8], m_rows, v_rows, decoupled, rounding,
                   r[9]);
    }
}
"""
_BF16_LIST = r"""
// table: n rows of (weight, gradient, compensation or 0, exp_avg, exp_avg_sq, numel, seed, exp_avg's seed,
// exp_avg_sq's seed)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t decoupled, int64_t rounding) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* r = table + 9 * i;
        one_tensor(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
                   reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<c10::BFloat16*>(r[3]),
                   reinterpret_cast<c10::BFloat16*>(r[4]), s, r[5], decoupled, rounding, r[6], r[7], r[8]);
    }
}
"""
_ONE = 'extern "C" void kernel('


def _quantized_values(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> dict[str, Any]:
    """What cpu_adam's quantized source is formatted with for a format and the weight's and gradient's dtypes."""
    bits, block = moments.FORMATS[fmt]
    fp8 = fmt == StatePrecision.FP8
    return {"bits": bits, "block": block, "unsigned_zero": int(not fp8 and q.codebook(bits, False)[0] == 0),
            "fp8": int(fp8), "p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}  # fmt: skip


@functools.cache
def _quantized(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = _quantized_values(fmt, p_dtype, g_dtype)
    source = (_QUANTIZED_SOURCE % values).replace(_ONE, "static void one_tensor(") + _QUANTIZED_LIST % values
    return _load(["const int64_t*", "int64_t", "const float*", "const int32_t*", "const float*", "const int32_t*",
                  "const float*"] + ["int64_t"] * 4, source)  # fmt: skip


@functools.cache
def _bf16_state(p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = {"p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}
    source = (_BF16_SOURCE % values).replace(_ONE, "static void one_tensor(") + _BF16_LIST % values
    return _load(["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t"], source)


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


def quantized_step(fmt: str, rows: list[tuple[Any, ...]], scalars: torch.Tensor, decoupled: bool,
                   rounding: int) -> None:  # fmt: skip
    """``cpu_adam.adam_step`` of every ``(weight, gradient, state, compensation or None, seed)`` of ``rows`` (one
    step count, weight and gradient dtypes alike; moments already quantized), in one call. Call where
    :func:`lists_build` and ``cpu_adam.available`` for each row."""
    p0, g0 = rows[0][0], rows[0][1]
    kernel = _quantized(fmt, p0.dtype, g0.dtype)
    m_table, m_lookup, v_table, v_lookup = cpu_adam._tables(fmt)
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), _pointer(c), st["exp_avg_codes"].data_ptr(),
                           st["exp_avg_scale"].data_ptr(), st["exp_avg_sq_codes"].data_ptr(),
                           st["exp_avg_sq_scale"].data_ptr(), p.numel(), st["exp_avg_scale"].numel(), seed]
                          for p, g, st, c, seed in rows], dtype=torch.int64)  # fmt: skip
    kernel(table, len(rows), m_table, m_lookup, v_table, v_lookup, scalars.contiguous(), m_lookup.numel() // 2,
           v_lookup.numel() // 2, int(decoupled), rounding)  # fmt: skip


def bf16_state_step(rows: list[tuple[Any, ...]], scalars: torch.Tensor, decoupled: bool, rounding: int) -> None:
    """``cpu_adam.bf16_adam_step`` of every ``(weight, gradient, exp_avg, exp_avg_sq, compensation or None, seed,
    exp_avg's seed, exp_avg_sq's seed)`` of ``rows`` (one step count, weight and gradient dtypes alike), in one
    call. Call where :func:`lists_build` and ``cpu_adam.bf16_available`` for each row."""
    kernel = _bf16_state(rows[0][0].dtype, rows[0][1].dtype)
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), _pointer(c), m.data_ptr(), v.data_ptr(), p.numel(), seed,
                           m_seed, v_seed] for p, g, m, v, c, seed, m_seed, v_seed in rows],
                         dtype=torch.int64)  # fmt: skip
    kernel(table, len(rows), scalars.contiguous(), int(decoupled), rounding)


_SGD_SOURCE = (
    _PRELUDE
    + r"""

// torch.optim.SGD's for-loop step on fp32 copies, as ATen computes it (add with alpha is one fused multiply-add, in
// its vector loop and its tail alike; mul rounds), the momentum buffer stored back to nearest; s: weight decay,
// momentum, 1 - dampening, -lr; flags: 1 nesterov, 2 maximize, 4 momentum
inline void sgd(BF16* p, const BF16* g, BF16* buf, BF16* comp, int64_t first, int64_t last, const float* s,
                int64_t flags, bool started, int64_t rounding, int64_t seed) {
    const bool nesterov = flags & 1, maximize = flags & 2, momentum = flags & 4;
    const VecF wd(s[0]), m(s[1]), damp(s[2]), neg_lr(s[3]);
    int64_t k = first;
    for (; k + VecF::size() <= last; k += VecF::size()) {
        const VecF pk = load_float(p + k);
        VecF gk = load_float(g + k);
        if (maximize) gk = gk.neg();
        if (s[0] != 0.0f) gk = at::vec::fmadd(pk, wd, gk);
        if (momentum) {
            const VecF b = started ? at::vec::fmadd(gk, damp, load_float(buf + k) * m) : gk;
            store_vec(buf + k, b);
            gk = nesterov ? at::vec::fmadd(b, m, gk) : b;
        }
        write_vec(p, comp, k, at::vec::fmadd(gk, neg_lr, pk), rounding, seed);
    }
    for (; k < last; ++k) {
        const float pk = to_float(p[k]);
        float gk = to_float(g[k]);
        if (maximize) gk = -gk;
        if (s[0] != 0.0f) gk = std::fma(pk, s[0], gk);
        if (momentum) {
            const float b = started ? std::fma(gk, s[2], to_float(buf[k]) * s[1]) : gk;
            store(buf + k, b);
            gk = nesterov ? std::fma(b, s[1], gk) : b;
        }
        write_one(p, comp, k, std::fma(gk, s[3], pk), pk, rounding, seed);
    }
}
}  // namespace

// table: n rows of (weight, gradient, momentum buffer or 0, compensation or 0, numel, seed, buffer started)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags, int64_t rounding) {
    over_chunks(table, n, 7, 4, [&](const int64_t* row, int64_t first, int64_t last) {
        sgd(reinterpret_cast<BF16*>(row[0]), reinterpret_cast<const BF16*>(row[1]), reinterpret_cast<BF16*>(row[2]),
            reinterpret_cast<BF16*>(row[3]), first, last, s, flags, row[6] != 0, rounding, row[5]);
    });
}
"""
)
#: the SGD kernel's flags
NESTEROV, MAXIMIZE, MOMENTUM = 1, 2, 4


@functools.cache
def _sgd() -> Any:
    return _load(
        ["const int64_t*", "int64_t", "const float*", "int64_t", "int64_t"], _SGD_SOURCE % {"helpers": _HELPERS}
    )


def sgd_available() -> bool:
    """Whether :func:`sgd_step` runs here (its kernel compiled once per process; a failure is remembered)."""
    return _builds(("sgd",), _sgd)


def _sgd_scalars(group: dict[str, Any]) -> torch.Tensor:
    """The SGD kernels' scalars: weight decay, momentum, 1 - dampening, -lr (torch hands each to ATen as a double,
    which its fp32 kernels narrow to fp32)."""
    return torch.tensor([float(group["weight_decay"]), float(group["momentum"]), 1.0 - float(group["dampening"]),
                         -float(group["lr"])], dtype=torch.float32)  # fmt: skip


def sgd_step(rows: list[tuple[Any, ...]], group: dict[str, Any], rounding: int) -> None:
    """torch.optim.SGD's step of every ``(weight, gradient, momentum buffer or None, compensation or None, seed,
    buffer started)`` of ``rows`` (bf16 CPU tensors, contiguous) with ``group``'s options, in one call, as torch's
    for-loop steps fp32 copies of them (bit for bit); the buffers (bf16) written back rounded to nearest, the
    weights with bf16-sr's noise (``rounding`` :data:`STOCHASTIC`, each its ``seed``) or Kahan's compensation."""
    momentum = float(group["momentum"])
    flags = (NESTEROV * bool(group.get("nesterov")) | MAXIMIZE * bool(group.get("maximize"))
             | MOMENTUM * (momentum != 0))  # fmt: skip
    scalars = _sgd_scalars(group)
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), _pointer(b), _pointer(c), p.numel(), seed, int(started)]
                          for p, g, b, c, seed, started in rows], dtype=torch.int64)  # fmt: skip
    _sgd()(table, len(rows), scalars, flags, rounding)


_SGD_BF16_STATE = (
    _PRELUDE
    + r"""
// SGD with a bf16 momentum buffer rounded stochastically (step.bf16_state.sgd_step): optim.sgd.sgd_update's
// arithmetic (ATen's add with alpha: one fused multiply-add), the buffer written with its own seed's noise

// s: weight decay, momentum, 1 - dampening, -lr; nesterov
inline void sgd(%(p_type)s* p, const %(g_type)s* g, BF16* buf, BF16* comp, int64_t first, int64_t last, const float* s,
                bool nesterov, bool started, int64_t rounding, int64_t seed, int64_t buf_seed) {
    const VecF wd(s[0]), m(s[1]), damp(s[2]), neg_lr(s[3]);
    int64_t k = first;
    for (; k + VecF::size() <= last; k += VecF::size()) {
        const VecF pk = load_float(p + k);
        VecF gk = load_float(g + k);
        if (s[0] != 0.0f) gk = at::vec::fmadd(pk, wd, gk);
        const VecF b = started ? at::vec::fmadd(gk, damp, load_float(buf + k) * m) : gk;
        store_vec(buf + k, vec_sr(b, k, buf_seed));
        const VecF d = nesterov ? at::vec::fmadd(b, m, gk) : b;
        write_vec(p, comp, k, at::vec::fmadd(d, neg_lr, pk), rounding, seed);
    }
    for (; k < last; ++k) {
        const float pk = to_float(p[k]);
        float gk = to_float(g[k]);
        if (s[0] != 0.0f) gk = std::fma(pk, s[0], gk);
        const float b = started ? std::fma(gk, s[2], to_float(buf[k]) * s[1]) : gk;
        buf[k] = BF16(sr(b, k, buf_seed));
        const float d = nesterov ? std::fma(b, s[1], gk) : b;
        write_one(p, comp, k, std::fma(d, s[3], pk), pk, rounding, seed);
    }
}
}  // namespace

// table: n rows of (weight, gradient, momentum buffer, compensation or 0, numel, seed, buffer's seed, started)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t nesterov, int64_t rounding) {
    over_chunks(table, n, 8, 4, [&](const int64_t* row, int64_t first, int64_t last) {
        sgd(reinterpret_cast<%(p_type)s*>(row[0]), reinterpret_cast<const %(g_type)s*>(row[1]),
            reinterpret_cast<BF16*>(row[2]), reinterpret_cast<BF16*>(row[3]), first, last, s, nesterov != 0,
            row[7] != 0, rounding, row[5], row[6]);
    });
}
"""
)


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
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), b.data_ptr(), _pointer(c), p.numel(), seed, b_seed,
                           int(started)] for p, g, b, c, seed, b_seed, started in rows], dtype=torch.int64)  # fmt: skip
    kernel(table, len(rows), scalars, int(bool(group["nesterov"])), rounding)


# SGD with a quantized momentum buffer: optim.sgd.sgd_step's arithmetic (ATen's add with alpha: one fused
# multiply-add) on cpu_adam's block helpers (the buffer dequantized, updated, measured and quantized a block at a
# time, as moments.load and moments.store do it), appended to cpu_adam's source for its format and dtypes
_SGD_QUANTIZED = r"""
namespace {
template <typename P, typename G>
inline void sgd_block(P* p, const G* g, c10::BFloat16* comp, uint8_t* codes, float* scale, const float* table,
                      const int32_t* lookup, const float* s, int64_t b, int64_t numel, int32_t rows, bool nesterov,
                      bool started, int64_t rounding, int64_t seed) {
    alignas(64) float buf[BLOCK], p32[BLOCK], g32[BLOCK];
    alignas(64) uint8_t unpacked[BLOCK];
    const int64_t first = b * BLOCK;
    const int64_t end = numel - first >= BLOCK ? BLOCK : (numel > first ? numel - first : 0);
    if (end == BLOCK) {
        const uint8_t* held = block_codes(codes, first, unpacked);
        const VecF bs(scale[b]), wd(s[0]), m(s[1]), damp(s[2]), neg_lr(s[3]);
        for (int64_t i = 0; i < BLOCK; i += VecF::size()) {
            const int64_t k = first + i;
            const VecF pk = load_float(p + k);
            VecF gk = load_float(g + k);
            if (s[0] != 0.0f) gk = at::vec::fmadd(pk, wd, gk);
            const VecF bk = started ? at::vec::fmadd(gk, damp, (vec_dequantize(table, held + i) * bs) * m) : gk;
            bk.store(buf + i);
            pk.store(p32 + i);
            gk.store(g32 + i);
        }
        const float next_scale = vec_absmax_clamped(buf);
        vec_quantize_block(buf, next_scale, lookup, rows, false, codes, first);
        scale[b] = next_scale;
        for (int64_t i = 0; i < BLOCK; i += VecF::size()) {
            const VecF bk = VecF::loadu(buf + i);
            const VecF d = nesterov ? at::vec::fmadd(bk, m, VecF::loadu(g32 + i)) : bk;
            write_vec(p, comp, first + i, at::vec::fmadd(d, neg_lr, VecF::loadu(p32 + i)), rounding, seed);
        }
        return;
    }
    const float bs = scale[b];
    for (int64_t i = 0; i < BLOCK; ++i) {
        const int64_t k = first + i;
        if (i >= end) {  // padding: the eager step stores zeros here
            buf[i] = 0.0f; p32[i] = 0.0f; g32[i] = 0.0f;
            continue;
        }
        p32[i] = to_float(p[k]);
        float gk = to_float(g[k]);
        if (s[0] != 0.0f) gk = std::fma(p32[i], s[0], gk);
        g32[i] = gk;
        buf[i] = started ? std::fma(gk, s[2], (dequantize(table, codes, k) * bs) * s[1]) : gk;
    }
    const float next_scale = absmax_clamped(buf);
    quantize_block(buf, next_scale, lookup, rows, false, codes, first);
    scale[b] = next_scale;
    for (int64_t i = 0; i < end; ++i) {
        const float d = nesterov ? std::fma(buf[i], s[1], g32[i]) : buf[i];
        write_one(p, comp, first + i, std::fma(d, s[3], p32[i]), p32[i], rounding, seed);
    }
}
}  // namespace

// table: n rows of (weight, gradient, compensation or 0, buffer codes, buffer scales, numel, blocks, seed, started);
// s: weight decay, momentum, 1 - dampening, -lr
extern "C" void kernel(const int64_t* table, int64_t n, const float* q_table, const int32_t* q_lookup,
                       const float* s, int64_t rows, int64_t nesterov, int64_t rounding) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* r = table + 9 * i;
        #pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < r[6]; ++b) {
            sgd_block(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
                      reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<uint8_t*>(r[3]),
                      reinterpret_cast<float*>(r[4]), q_table, q_lookup, s, b, r[5], (int32_t)rows, nesterov != 0,
                      r[8] != 0, rounding, r[7]);
        }
    }
}
"""


@functools.cache
def _sgd_quantized(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    values = _quantized_values(fmt, p_dtype, g_dtype)
    source = (_QUANTIZED_SOURCE % values).replace(_ONE, "static void one_tensor(") + _SGD_QUANTIZED % values
    return _load(["const int64_t*", "int64_t", "const float*", "const int32_t*", "const float*"] + ["int64_t"] * 3,
                 source)  # fmt: skip


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
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), _pointer(c), st["momentum_buffer_codes"].data_ptr(),
                           st["momentum_buffer_scale"].data_ptr(), p.numel(), st["momentum_buffer_scale"].numel(),
                           seed, int(started)] for p, g, st, c, seed, started in rows], dtype=torch.int64)  # fmt: skip
    kernel(table, len(rows), signed_table, signed_lookup, scalars, signed_lookup.numel() // 2,
           int(bool(group["nesterov"])), rounding)  # fmt: skip
