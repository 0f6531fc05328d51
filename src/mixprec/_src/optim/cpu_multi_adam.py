"""bf16-sr's and bf16-kahan's Adam(W) step on the CPU for every bf16 weight of a param group in one call.

``prepare``'s bf16-sr and bf16-kahan levels step each bf16 weight with a compiled fused kernel
(``prepare.sr_kernel.adam_sr_update``, ``prepare.kahan.adam_kahan_update``): one call a parameter, each with
its Python overhead and its own small tensors (views, a seed). Here one C++ call steps a whole list: a table of
the tensors' addresses, sizes and seeds, split into chunks of 4096 values that OpenMP shares out across the
list (a small tensor is not a thread's whole turn), each chunk read and written once. The arithmetic is the
compiled kernels', operation for operation and rounding for rounding (fp32 on bf16 storage; no contraction,
as inductor compiles; IEEE division and square root in both): weights, moments and compensations come out
bitwise equal to theirs (tests/optim/test_cpu_multi_adam.py). The rounding of the weight is ``cpu_adam``'s
(bf16-sr's noise at each flat position, or Kahan's compensated write). Compiled once per process with the
toolchain inductor uses; where it is missing, :func:`available` is false and the per-tensor kernels run.
Nothing here syncs with a device: CPU tensors only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mixprec._src.optim.cpu_adam import _HELPERS, KAHAN, STOCHASTIC

__all__ = ["KAHAN", "STOCHASTIC", "adam_step", "available", "takes"]

_SOURCE = r"""
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

// sr_kernel.adam_sr_update / kahan.adam_kahan_update on values [first, last) of one tensor: s holds their nine
// scalars (decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, lr / bias correction 1, 1 / sqrt(bias correction 2), eps)
inline void update(BF16* p, const BF16* g, BF16* m, BF16* v, BF16* comp, int64_t first, int64_t last,
                   const float* s, int64_t rounding, int64_t seed) {
    const VecF decay(s[0]), l2(s[1]), beta1(s[2]), omb1(s[3]), beta2(s[4]), omb2(s[5]), step(s[6]), bc2(s[7]);
    const VecF eps(s[8]);
    int64_t k = first;
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
    std::vector<int64_t> starts(n + 1, 0);  // each tensor's first chunk in the list's
    for (int64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + (table[7 * i + 5] + CHUNK - 1) / CHUNK;
    const int64_t chunks = starts[n];
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = std::upper_bound(starts.begin(), starts.end(), c) - starts.begin() - 1;
        const int64_t* row = table + 7 * i;
        const int64_t first = (c - starts[i]) * CHUNK, last = std::min(first + CHUNK, row[5]);
        update(reinterpret_cast<BF16*>(row[0]), reinterpret_cast<const BF16*>(row[1]), reinterpret_cast<BF16*>(row[2]),
               reinterpret_cast<BF16*>(row[3]), reinterpret_cast<BF16*>(row[4]), first, last, s, rounding, row[6]);
    }
}
"""
_failed = False


@functools.cache
def _compiled() -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(["const int64_t*", "int64_t", "const float*", "int64_t"],
                                                     _SOURCE % {"helpers": _HELPERS},
                                                     extra_flags=("-ffp-contract=off",))  # fmt: skip


def available() -> bool:
    """Whether the kernel runs here (compiled at the first call, once per process; a failure is remembered)."""
    global _failed
    if _failed:
        return False
    try:
        _compiled()
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed = True
    return not _failed


def takes(*tensors: torch.Tensor) -> bool:
    """Whether a weight's tensors (weight, gradient, moments, compensation) go in the kernel's list: contiguous bf16
    CPU tensors."""
    return all(t.device.type == "cpu" and t.dtype is torch.bfloat16 and t.is_contiguous() for t in tensors)


def adam_step(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
              scalars: torch.Tensor, rounding: int) -> None:  # fmt: skip
    """Step every ``(weight, gradient, exp_avg, exp_avg_sq, compensation, seed)`` of ``rows`` in place, in one call;
    ``scalars``: ``sr_kernel.adam_scalars``' nine (one step count for the whole list), ``rounding``: :data:`STOCHASTIC`
    (each weight's ``seed``) or :data:`KAHAN` (each its ``compensation``). Call where :func:`available` and every
    row's tensors are :func:`takes`."""
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if c is None else c.data_ptr(),
                           p.numel(), seed] for p, g, m, v, c, seed in rows], dtype=torch.int64)  # fmt: skip
    _compiled()(table, len(rows), scalars.contiguous(), rounding)
