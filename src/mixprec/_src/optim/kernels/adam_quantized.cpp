// adam_quantized.cpp: C++ for optim/cpu_adam.py, which fills its named percent fields and builds it with inductor's toolchain.

#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
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
// the step of block b of one tensor: whole_block where the block holds real values only, else a value at a time
template <typename P, typename G>
inline void step_block(P* p, const G* g, c10::BFloat16* comp, uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                       float* v_scale, const float* m_table, const int32_t* m_lookup, const float* v_table,
                       const int32_t* v_lookup, const float* scalars, int64_t numel, int64_t b, int32_t m_rows,
                       int32_t v_rows, bool decoupled, int64_t rounding, int64_t seed) {
    if (b < numel / BLOCK) {  // blocks of real values only: the vectorized path
        whole_block(p, g, comp, m_codes, m_scale, v_codes, v_scale, m_table, m_lookup, v_table, v_lookup, scalars, b,
                    m_rows, v_rows, decoupled, rounding, seed);
        return;
    }
    const float lr = scalars[0], weight_decay = scalars[1], one_minus_beta1 = scalars[2];
    const float one_minus_beta2 = scalars[3], bias_correction1 = scalars[4], bias_correction2_sqrt = scalars[5];
    const float eps = scalars[6];
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
    quantize_block(m, m_new_scale, m_lookup, m_rows, false, m_codes, first);
    quantize_block(v, v_new_scale, v_lookup, v_rows, true, v_codes, first);
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
}  // namespace

extern "C" void kernel(%(p_type)s* p, const %(g_type)s* g, c10::BFloat16* comp,
                       uint8_t* m_codes, float* m_scale, uint8_t* v_codes, float* v_scale,
                       const float* m_table, const int32_t* m_lookup, const float* v_table, const int32_t* v_lookup,
                       const float* scalars, int64_t numel, int64_t blocks, int64_t m_rows, int64_t v_rows,
                       int64_t decoupled, int64_t rounding, int64_t seed) {
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        step_block(p, g, comp, m_codes, m_scale, v_codes, v_scale, m_table, m_lookup, v_table, v_lookup, scalars, numel,
                   b, (int32_t)m_rows, (int32_t)v_rows, decoupled != 0, rounding, seed);
    }
}
