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

import functools
from typing import Any

import torch

from mixprec._src.optim import moments
from mixprec._src.optim import quantize as q
from mixprec._src.optim.state_precision import StatePrecision

__all__ = [
    "adam_step",
    "available",
    "bf16_adam_step",
    "bf16_available",
    "bf16_builds",
    "bf16_expected",
    "rounding_mode",
    "square_norm",
]

#: how the new weight is written: rounded to nearest, stochastically (bf16-sr), or with Kahan's compensation
NEAREST, STOCHASTIC, KAHAN = 0, 1, 2


def rounding_mode(stochastic: bool, compensated: bool) -> int:
    """How the kernel writes a weight: with bf16-kahan's compensation, bf16-sr's noise, or to nearest."""
    return KAHAN if compensated else STOCHASTIC if stochastic else NEAREST


_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace {
constexpr int32_t LAST_ROW = 0x3F800000 >> 16;
constexpr int32_t WEYL = -1640531535;
constexpr int64_t BLOCK = %(block)d;
constexpr int BITS = %(bits)d;
constexpr bool UNSIGNED_ZERO = %(unsigned_zero)d;  // the second moment's codebook has a zero entry
constexpr bool FP8 = %(fp8)d;  // codes are e4m3 values (quantize.quantize_fp8), not codebook indices
using Fp8 = c10::Float8_e4m3fn;

%(helpers)s
// quantize.lookup_codes
inline int32_t lookup_code(float x, const int32_t* lookup, int32_t rows) {
    const int32_t raw = bits_of(x);
    const int32_t negative = raw < 0 ? 1 : 0;
    const int32_t first = LAST_ROW + 1 - rows;
    int32_t row = (raw & 0x7FFFFFFF) >> 16;
    row = row < first ? first : row;
    row = row > LAST_ROW ? LAST_ROW : row;
    const int32_t entry = lookup[row - first + negative * rows];
    const int32_t key = (raw & 0xFFFF) ^ (negative * 0xFFFF);
    return (entry >> 17) + (key >= (entry & 0x1FFFF) ? 1 : 0);
}

inline float fp8_value(uint8_t bits) { return static_cast<float>(Fp8(bits, Fp8::from_bits())); }

// quantize.quantize_fp8's value: a positive second moment that e4m3 would round to 0 (at or below 2**-10) takes
// its smallest value, 2**-9
inline float fp8_departure(float scaled, bool second) {
    return second && scaled > 0.0f && scaled <= 0x1p-10f ? 0x1p-9f : scaled;
}

inline int32_t code_at(const uint8_t* codes, int64_t k) {
    if (BITS == 8) return codes[k];
    const uint8_t byte = codes[k >> 1];
    return (k & 1) ? (byte & 0xF) : (byte >> 4);
}

inline float dequantize(const float* table, const uint8_t* codes, int64_t k) {
    return FP8 ? fp8_value(codes[k]) : table[code_at(codes, k)];
}

inline float clamped_scale(float best, bool nan) {  // clamp(min=1e-12), and e4m3's largest value at fp8
    if (nan) return from_bits(0x7FC00000);
    best = best < 1e-12f ? 1e-12f : best;
    return FP8 ? best / 448.0f : best;
}

inline float absmax_clamped(const float* x) {  // torch's amax (NaN wins), then the scale
    float best = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < BLOCK; ++i) {
        const float a = std::abs(x[i]);
        nan |= a != a;
        best = a > best ? a : best;
    }
    return clamped_scale(best, nan);
}

inline void quantize_block(const float* x, float scale, const int32_t* lookup, int32_t rows, bool second,
                           uint8_t* codes, int64_t first) {
    if (FP8) {
        for (int64_t i = 0; i < BLOCK; ++i) codes[first + i] = Fp8(fp8_departure(x[i] / scale, second)).x;
        return;
    }
    int32_t c[BLOCK];
    for (int64_t i = 0; i < BLOCK; ++i) {
        const float scaled = x[i] / scale;
        int32_t code = lookup_code(scaled, lookup, rows);
        if (second && UNSIGNED_ZERO && scaled > 0.0f && code == 0) code = 1;
        c[i] = code;
    }
    if (BITS == 8) {
        for (int64_t i = 0; i < BLOCK; ++i) codes[first + i] = static_cast<uint8_t>(c[i]);
    } else {
        for (int64_t i = 0; i < BLOCK; i += 2)
            codes[(first + i) >> 1] = static_cast<uint8_t>(((c[i] & 0xFF) << 4) | (c[i + 1] & 0xFF));
    }
}


inline VecI load_codes(const uint8_t* codes) {  // one code a byte
    return at::vec::convert<int32_t>(at::vec::Vectorized<uint8_t>::loadu(codes, VecF::size()));
}

// a block's codes one a byte: 8-bit codes as they are stored, 4-bit ones unpacked (the first value in the high half)
inline const uint8_t* block_codes(const uint8_t* codes, int64_t first, uint8_t* unpacked) {
    if (BITS == 8) return codes + first;
    const uint8_t* bytes = codes + (first >> 1);
#ifdef __SSE2__
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < BLOCK / 2; j += 16) {  // 16 bytes: their high halves and low halves, interleaved
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low), rest = _mm_and_si128(packed, low);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(unpacked + 2 * j), _mm_unpacklo_epi8(high, rest));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(unpacked + 2 * j + 16), _mm_unpackhi_epi8(high, rest));
    }
#else
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
        unpacked[2 * j] = bytes[j] >> 4;
        unpacked[2 * j + 1] = bytes[j] & 0xF;
    }
#endif
    return unpacked;
}

inline float vec_absmax_clamped(const float* x) {
    VecF best(0.0f);
    for (int64_t i = 0; i < BLOCK; i += VecF::size()) best = at::vec::maximum(best, VecF::loadu(x + i).abs());
    alignas(64) float lanes[VecF::size()];
    best.store(lanes);
    float out = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < VecF::size(); ++i) { nan |= lanes[i] != lanes[i]; out = lanes[i] > out ? lanes[i] : out; }
    return clamped_scale(out, nan);
}

inline VecF vec_dequantize(const float* table, const uint8_t* codes) {
    if (FP8) {
        const Fp8* values = reinterpret_cast<const Fp8*>(codes);
        return at::vec::convert<float>(at::vec::Vectorized<Fp8>::loadu(values, VecF::size()));
    }
    return at::vec::gather<4>(table, load_codes(codes));
}

inline VecI vec_lookup(const VecF& x, const int32_t* lookup, int32_t rows) {
    const VecI raw = at::vec::cast<int32_t>(x);
    const VecI negative = (raw < VecI(0)) & VecI(1);
    const int32_t first = LAST_ROW + 1 - rows;
    VecI row = (raw & VecI(0x7FFFFFFF)) >> VecI(16);
    row = at::vec::minimum(at::vec::maximum(row, VecI(first)), VecI(LAST_ROW)) - VecI(first) + negative * VecI(rows);
    const VecI entry = at::vec::cast<int32_t>(at::vec::gather<4>(reinterpret_cast<const float*>(lookup), row));
    const VecI key = (raw & VecI(0xFFFF)) ^ (negative * VecI(0xFFFF));
    return (entry >> VecI(17)) + ((key >= (entry & VecI(0x1FFFF))) & VecI(1));
}

// a block's 4-bit codes (one a byte, each below 16) two to a byte, the first in the high half
inline void pack_codes(const uint8_t* c, uint8_t* out) {
#ifdef __SSE2__
    const __m128i even = _mm_set1_epi16(0x00FF);
    for (int64_t j = 0; j < BLOCK; j += 32) {  // per 16-bit lane: an even code in its low byte, the next above it
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j + 16));
        const __m128i pa = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(a, even), 4), _mm_srli_epi16(a, 8));
        const __m128i pb = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, even), 4), _mm_srli_epi16(b, 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j / 2), _mm_packus_epi16(pa, pb));
    }
#else
    for (int64_t j = 0; j < BLOCK / 2; ++j) out[j] = static_cast<uint8_t>((c[2 * j] << 4) | c[2 * j + 1]);
#endif
}

inline void vec_quantize_block(const float* x, float scale, const int32_t* lookup, int32_t rows, bool second,
                               uint8_t* codes, int64_t first) {
    alignas(64) uint8_t c[BLOCK];
    uint8_t* out = BITS == 8 ? codes + first : c;
    for (int64_t i = 0; i < BLOCK; i += VecF::size()) {
        VecF scaled = VecF::loadu(x + i) / VecF(scale);
        if (FP8) {
            if (second) {
                const VecF tiny = (scaled > VecF(0.0f)) & (scaled <= VecF(0x1p-10f));
                scaled = VecF::blendv(scaled, VecF(0x1p-9f), tiny);
            }
            at::vec::convert<Fp8>(scaled).store(reinterpret_cast<Fp8*>(codes + first + i), VecF::size());
            continue;
        }
        VecI code = vec_lookup(scaled, lookup, rows);
        if (second && UNSIGNED_ZERO) {
            const VecI positive = at::vec::cast<int32_t>(scaled > VecF(0.0f));
            code = VecI::blendv(code, VecI(1), positive & (code == VecI(0)));
        }
        at::vec::convert<uint8_t>(code).store(out + i, VecF::size());
    }
    if (BITS == 4) pack_codes(c, codes + (first >> 1));
}

template <typename P, typename G>
inline void whole_block(P* p, const G* g, c10::BFloat16* comp, uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                        float* v_scale, const float* m_table, const int32_t* m_lookup, const float* v_table,
                        const int32_t* v_lookup, const float* s, int64_t b, int32_t m_rows, int32_t v_rows,
                        bool decoupled, int64_t rounding, int64_t seed) {
    alignas(64) float m[BLOCK], v[BLOCK], p32[BLOCK];
    alignas(64) uint8_t m_unpacked[BLOCK], v_unpacked[BLOCK];
    const int64_t first = b * BLOCK;
    const uint8_t* m_block = block_codes(m_codes, first, m_unpacked);
    const uint8_t* v_block = block_codes(v_codes, first, v_unpacked);
    const VecF ms(m_scale[b]), vs(v_scale[b]), decay(s[1]);
    for (int64_t i = 0; i < BLOCK; i += VecF::size()) {
        const int64_t k = first + i;
        VecF pk = load_float(p + k), gk = load_float(g + k);
        if (decoupled) pk = pk - decay * pk;
        else gk = gk + decay * pk;
        pk.store(p32 + i);
        const VecF dm = vec_dequantize(m_table, m_block + i) * ms;
        const VecF dv = vec_dequantize(v_table, v_block + i) * vs;
        vec_lerp(dm, gk, s[2]).store(m + i);
        vec_lerp(dv, gk * gk, s[3]).store(v + i);
    }
    const float m_new = vec_absmax_clamped(m), v_new = vec_absmax_clamped(v);
    vec_quantize_block(m, m_new, m_lookup, m_rows, false, m_codes, first);
    vec_quantize_block(v, v_new, v_lookup, v_rows, true, v_codes, first);
    m_scale[b] = m_new;
    v_scale[b] = v_new;
    const VecF lr(s[0]), bc1(s[4]), bc2(s[5]), eps(s[6]);
    for (int64_t i = 0; i < BLOCK; i += VecF::size()) {
        const int64_t k = first + i;
        const VecF denom = VecF::loadu(v + i).sqrt() / bc2 + eps;
        const VecF next = VecF::loadu(p32 + i) - (lr * (VecF::loadu(m + i) / bc1)) / denom;
        write_vec(p, comp, k, next, rounding, seed);
    }
}
}  // namespace

extern "C" void kernel(%(p_type)s* p, const %(g_type)s* g, c10::BFloat16* comp,
                       uint8_t* m_codes, float* m_scale, uint8_t* v_codes, float* v_scale,
                       const float* m_table, const int32_t* m_lookup, const float* v_table, const int32_t* v_lookup,
                       const float* scalars, int64_t numel, int64_t blocks, int64_t m_rows, int64_t v_rows,
                       int64_t decoupled, int64_t rounding, int64_t seed) {
    const float lr = scalars[0], weight_decay = scalars[1], one_minus_beta1 = scalars[2];
    const float one_minus_beta2 = scalars[3], bias_correction1 = scalars[4], bias_correction2_sqrt = scalars[5];
    const float eps = scalars[6];
    const int64_t whole = numel / BLOCK;  // blocks of real values only: the vectorized path
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        if (b < whole) {
            whole_block(p, g, comp, m_codes, m_scale, v_codes, v_scale, m_table, m_lookup, v_table, v_lookup, scalars,
                        b, (int32_t)m_rows, (int32_t)v_rows, decoupled != 0, rounding, seed);
            continue;
        }
        float m[BLOCK], v[BLOCK], p32[BLOCK], w[BLOCK];
        const int64_t first = b * BLOCK;
        const float ms = m_scale[b], vs = v_scale[b];
        for (int64_t i = 0; i < BLOCK; ++i) {
            const int64_t k = first + i;
            if (k >= numel) {  // padding: the eager step stores zeros here
                m[i] = 0.0f; v[i] = 0.0f; p32[i] = 0.0f; w[i] = 0.0f;
                continue;
            }
            w[i] = to_float(p[k]);
            float pk = w[i];
            float gk = to_float(g[k]);
            if (decoupled) pk = pk - weight_decay * pk;  // weight_decay: lr * weight_decay here
            else gk = gk + weight_decay * pk;
            p32[i] = pk;
            m[i] = lerp(dequantize(m_table, m_codes, k) * ms, gk, one_minus_beta1);
            v[i] = lerp(dequantize(v_table, v_codes, k) * vs, gk * gk, one_minus_beta2);
        }
        const float m_new_scale = absmax_clamped(m), v_new_scale = absmax_clamped(v);
        quantize_block(m, m_new_scale, m_lookup, (int32_t)m_rows, false, m_codes, first);
        quantize_block(v, v_new_scale, v_lookup, (int32_t)v_rows, true, v_codes, first);
        m_scale[b] = m_new_scale;
        v_scale[b] = v_new_scale;
        const int64_t end = numel - first < BLOCK ? numel - first : BLOCK;
        for (int64_t i = 0; i < end; ++i) {
            const float denom = std::sqrt(v[i]) / bias_correction2_sqrt + eps;
            const float next = p32[i] - (lr * (m[i] / bias_correction1)) / denom;
            const int64_t k = first + i;
            write_one(p, comp, k, next, w[i], rounding, seed);
        }
    }
}
"""

#: what both kernels share: bit casts, fp32 and bf16 loads and stores, ATen's lerp, bf16-sr's noise, the weight's
#: writes, ATen's vector types
_HELPERS = """using VecF = at::vec::Vectorized<float>;
using VecI = at::vec::Vectorized<int32_t>;

inline int32_t bits_of(float x) { int32_t r; std::memcpy(&r, &x, 4); return r; }
inline float from_bits(int32_t r) { float x; std::memcpy(&x, &r, 4); return x; }
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline void store(float* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }  // round to nearest even, as copy_

// ATen's lerp (its vectorized form): one fused multiply-add
inline float lerp(float start, float end, float weight) {
    return std::abs(weight) < 0.5f ? std::fma(weight, end - start, start) : std::fma(weight - 1.0f, end - start, end);
}

inline VecF load_float(const float* x) { return VecF::loadu(x); }
inline VecF load_float(const c10::BFloat16* x) {
    return at::vec::convert<float>(at::vec::Vectorized<c10::BFloat16>::loadu(x, VecF::size()));
}
inline void store_vec(float* p, const VecF& x) { x.store(p); }
inline void store_vec(c10::BFloat16* p, const VecF& x) { at::vec::convert<c10::BFloat16>(x).store(p, VecF::size()); }
inline VecF vec_lerp(const VecF& start, const VecF& end, float weight) {
    return std::abs(weight) < 0.5f ? at::vec::fmadd(VecF(weight), end - start, start)
                                   : at::vec::fmadd(VecF(weight - 1.0f), end - start, end);
}

// sr_noise.sr_bits at flat positions pos, pos + 1, ... (the seed's): fp32 bits with 16 low zeros (exact in bf16)
// (pos + lane) * W + seed == lane * W + (pos * W + seed) in 32-bit wrapping arithmetic: one broadcast a vector, the
// lanes' multiples of W made once
inline VecF vec_sr(const VecF& x, int64_t pos, int64_t seed) {
    static const VecI lanes = VecI::arange(0, 1) * VecI(WEYL);
    const int32_t start = static_cast<int32_t>(static_cast<uint32_t>(pos) * static_cast<uint32_t>(WEYL)
                                               + static_cast<uint32_t>(seed));
    const VecI noise = ((lanes + VecI(start)) >> VecI(16)) & VecI(0xFFFF);
    return at::vec::cast<float>((at::vec::cast<int32_t>(x) + noise) & VecI(-(1 << 16)));
}
inline float sr(float x, int64_t pos, int64_t seed) {
    const int32_t noise = ((int32_t)((uint32_t)pos * (uint32_t)WEYL + (uint32_t)seed) >> 16) & 0xFFFF;
    return from_bits((int32_t)((uint32_t)bits_of(x) + (uint32_t)noise) & -(1 << 16));
}

// the new weights at k, ..., written as rounding says: to nearest (0), bf16-sr's noise (1), kahan.write (2)
template <typename P>
inline void write_vec(P* p, c10::BFloat16* comp, int64_t k, const VecF& next, int64_t rounding, int64_t seed) {
    if (rounding == 1) {
        store_vec(p + k, vec_sr(next, k, seed));
    } else if (rounding == 2) {
        const VecF w = load_float(p + k);
        const VecF sum = w + ((next - w) + load_float(comp + k));
        store_vec(p + k, sum);
        store_vec(comp + k, sum - load_float(p + k));
    } else {
        store_vec(p + k, next);
    }
}
template <typename P>
inline void write_one(P* p, c10::BFloat16* comp, int64_t k, float next, float w, int64_t rounding, int64_t seed) {
    if (rounding == 1) {
        store(p + k, sr(next, k, seed));
    } else if (rounding == 2) {
        const float sum = w + ((next - w) + static_cast<float>(comp[k]));
        store(p + k, sum);
        comp[k] = c10::BFloat16(sum - to_float(p[k]));
    } else {
        store(p + k, next);
    }
}
"""
_CTYPES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16"}
_failed: set[tuple[Any, ...]] = set()


@functools.cache
def _compiled(fmt: str, p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    """The kernel of a format and the weight's and gradient's dtypes (compiled at its first use, then from
    inductor's cache on disk)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    bits, block = moments.FORMATS[fmt]
    fp8 = fmt == StatePrecision.FP8
    source = _SOURCE % {"bits": bits, "block": block, "unsigned_zero": int(not fp8 and q.codebook(bits, False)[0] == 0),
                        "fp8": int(fp8), "p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype],
                        "helpers": _HELPERS}  # fmt: skip
    argtypes = [f"{_CTYPES[p_dtype]}*", f"const {_CTYPES[g_dtype]}*", "c10::BFloat16*", "uint8_t*", "float*",
                "uint8_t*", "float*", "const float*", "const int32_t*", "const float*", "const int32_t*",
                "const float*"] + ["int64_t"] * 7  # fmt: skip
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, extra_flags=("-ffp-contract=off",))


def available(fmt: str, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether this step runs here: a quantized state of a contiguous CPU fp32/bf16 weight and gradient,
    and the kernel compiles (once per process and kind; a failure is remembered)."""
    if fmt not in moments.FORMATS or p.device.type != "cpu" or grad.device.type != "cpu":
        return False
    if p.dtype not in _CTYPES or grad.dtype not in _CTYPES or not (p.is_contiguous() and grad.is_contiguous()):
        return False
    key = (fmt, p.dtype, grad.dtype)
    if key in _failed:
        return False
    try:
        _compiled(*key)
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed.add(key)
        return False
    return True


@functools.cache
def _tables(fmt: str) -> tuple[torch.Tensor, ...]:
    if fmt == StatePrecision.FP8:  # e4m3 codes are their own values: no codebook, no lookup (the kernel reads neither)
        empty = torch.zeros(2)
        return empty, empty.int(), empty, empty.int()
    bits = moments.FORMATS[fmt][0]
    cpu = torch.device("cpu")
    return (q.table(bits, True, cpu), q.code_lookup(bits, True, cpu), q.table(bits, False, cpu),
            q.code_lookup(bits, False, cpu))  # fmt: skip


_NO_COMP = torch.zeros(1, dtype=torch.bfloat16)


def adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], scalars: torch.Tensor, decoupled: bool,
              fmt: str, rounding: int = NEAREST, seed: int = 0, comp: torch.Tensor | None = None) -> None:  # fmt: skip
    """One step of ``p`` (in place) and its quantized moments in ``state`` (allocated, ``step`` counted):
    ``scalars`` are ``fused_adam``'s seven (lr, the weight decay as applied, 1 - beta1, 1 - beta2, the bias
    corrections), ``rounding`` how the weight is written (``seed``: bf16-sr's for the weight's first value;
    ``comp``: bf16-kahan's compensation). Call where :func:`available`."""
    m_table, m_lookup, v_table, v_lookup = _tables(fmt)
    kernel = _compiled(fmt, p.dtype, grad.dtype)
    kernel(p, grad, _NO_COMP if comp is None else comp, state["exp_avg_codes"], state["exp_avg_scale"],
           state["exp_avg_sq_codes"], state["exp_avg_sq_scale"], m_table, m_lookup, v_table, v_lookup,
           scalars.contiguous(), p.numel(), state["exp_avg_scale"].numel(), m_lookup.numel() // 2,
           v_lookup.numel() // 2, int(decoupled), rounding, seed)  # fmt: skip


_BF16_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstdint>
#include <cstring>

// Adam(W) with bf16 moments rounded stochastically (step.bf16_state): adam.adam_update's arithmetic, operation
// for operation (the quantized kernel's), each moment written with sr_noise.sr_bits' noise of its own seed
namespace {
constexpr int32_t WEYL = -1640531535;
constexpr int64_t CHUNK = 4096;
%(helpers)s
}  // namespace

extern "C" void kernel(%(p_type)s* p, const %(g_type)s* g, c10::BFloat16* comp, c10::BFloat16* m,
                       c10::BFloat16* v, const float* s, int64_t numel, int64_t decoupled, int64_t rounding,
                       int64_t seed, int64_t m_seed, int64_t v_seed) {
    const int64_t chunks = (numel + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * CHUNK, last = first + CHUNK < numel ? first + CHUNK : numel;
        const VecF lr(s[0]), decay(s[1]), bc1(s[4]), bc2(s[5]), eps(s[6]);
        int64_t k = first;
        for (; k + VecF::size() <= last; k += VecF::size()) {
            VecF pk = load_float(p + k), gk = load_float(g + k);
            if (decoupled) pk = pk - decay * pk;
            else gk = gk + decay * pk;
            const VecF mk = vec_lerp(load_float(m + k), gk, s[2]);
            const VecF vk = vec_lerp(load_float(v + k), gk * gk, s[3]);
            store_vec(m + k, vec_sr(mk, k, m_seed));
            store_vec(v + k, vec_sr(vk, k, v_seed));
            write_vec(p, comp, k, pk - (lr * (mk / bc1)) / (vk.sqrt() / bc2 + eps), rounding, seed);
        }
        for (; k < last; ++k) {
            const float w = to_float(p[k]);
            float pk = w, gk = to_float(g[k]);
            if (decoupled) pk = pk - s[1] * pk;
            else gk = gk + s[1] * pk;
            const float mk = lerp(to_float(m[k]), gk, s[2]), vk = lerp(to_float(v[k]), gk * gk, s[3]);
            m[k] = c10::BFloat16(sr(mk, k, m_seed));
            v[k] = c10::BFloat16(sr(vk, k, v_seed));
            write_one(p, comp, k, pk - (s[0] * (mk / s[4])) / (std::sqrt(vk) / s[5] + s[6]), w, rounding, seed);
        }
    }
}
"""


@functools.cache
def _bf16_compiled(p_dtype: torch.dtype, g_dtype: torch.dtype) -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = _BF16_SOURCE % {"p_type": _CTYPES[p_dtype], "g_type": _CTYPES[g_dtype], "helpers": _HELPERS}
    argtypes = [f"{_CTYPES[p_dtype]}*", f"const {_CTYPES[g_dtype]}*", "c10::BFloat16*", "c10::BFloat16*",
                "c10::BFloat16*", "const float*"] + ["int64_t"] * 6  # fmt: skip
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, extra_flags=("-ffp-contract=off",))


def bf16_available(p: torch.Tensor, grad: torch.Tensor, *state: torch.Tensor) -> bool:
    """Whether :func:`bf16_adam_step` runs here: contiguous CPU fp32/bf16 weight and gradient, contiguous bf16
    moments, and the kernel compiles."""
    tensors = (p, grad, *state)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
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
    if p_dtype not in _CTYPES or g_dtype not in _CTYPES or key in _failed:
        return False
    try:
        _bf16_compiled(p_dtype, g_dtype)
    except Exception:  # no C++ toolchain, an unsupported platform
        _failed.add(key)
        return False
    return True


def bf16_adam_step(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor,
                   decoupled: bool, seeds: tuple[int, int], rounding: int = NEAREST, seed: int = 0,
                   comp: torch.Tensor | None = None) -> None:  # fmt: skip
    """One Adam(W) step of ``p`` (in place) with its bf16 moments ``m`` and ``v`` (in place), each written with
    stochastic rounding from its seed in ``seeds`` (its first value's); ``scalars``, ``rounding``, ``seed``,
    ``comp``: as :func:`adam_step`'s. Call where :func:`bf16_available`."""
    kernel = _bf16_compiled(p.dtype, grad.dtype)
    kernel(p, grad, _NO_COMP if comp is None else comp, m, v, scalars.contiguous(), p.numel(), int(decoupled),
           rounding, seed, seeds[0], seeds[1])  # fmt: skip


_NORM_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <vector>

// the sum of squares of n low-precision values in fp32: fixed chunks (so the sum is the same whatever the
// threads), each summed in vector lanes, the lanes and then the chunks added in order
extern "C" void kernel(const %(x_type)s* x, float* out, int64_t n) {
    using VecF = at::vec::Vectorized<float>;
    constexpr int64_t CHUNK = 1 << 16;
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<float> partial(chunks);
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * CHUNK, last = first + CHUNK < n ? first + CHUNK : n;
        VecF acc(0.0f);
        int64_t i = first;
        for (; i + VecF::size() <= last; i += VecF::size()) {
            const VecF v = at::vec::convert<float>(at::vec::Vectorized<%(x_type)s>::loadu(x + i, VecF::size()));
            acc = at::vec::fmadd(v, v, acc);
        }
        alignas(64) float lanes[VecF::size()];
        acc.store(lanes);
        float sum = 0.0f;
        for (int64_t j = 0; j < VecF::size(); ++j) sum += lanes[j];
        for (; i < last; ++i) { const float v = static_cast<float>(x[i]); sum += v * v; }
        partial[c] = sum;
    }
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += partial[c];
    out[0] = total;
}
"""
_LOW = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}


@functools.cache
def _norm_kernel(dtype: torch.dtype) -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    ctype = _LOW[dtype]
    return CppPythonBindingsCodeCache.load_pybinding([f"const {ctype}*", "float*", "int64_t"],
                                                     _NORM_SOURCE % {"x_type": ctype})  # fmt: skip


def square_norm(x: torch.Tensor) -> torch.Tensor | None:
    """The fp32 sum of squares of a contiguous bf16 or fp16 CPU tensor, read where it lies (no fp32 copy); ``None``
    where this does not run here (another dtype or device, no toolchain)."""
    if x.dtype not in _LOW or x.device.type != "cpu" or not x.is_contiguous() or ("norm", x.dtype) in _failed:
        return None
    try:
        kernel = _norm_kernel(x.dtype)
    except Exception:  # no C++ toolchain
        _failed.add(("norm", x.dtype))
        return None
    out = torch.empty((), dtype=torch.float32)
    kernel(x, out, x.numel())
    return out
