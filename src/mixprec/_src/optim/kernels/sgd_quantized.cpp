// sgd_quantized.cpp: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

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
    constexpr int64_t chunk_blocks = BLOCK < 4096 ? 4096 / BLOCK : 1;  // about 4096 values a chunk of the list's work
    over_chunks(table, n, 9, 6, chunk_blocks, [&](const int64_t* r, int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            sgd_block(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
                      reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<uint8_t*>(r[3]),
                      reinterpret_cast<float*>(r[4]), q_table, q_lookup, s, b, r[5], (int32_t)rows, nesterov != 0,
                      r[8] != 0, rounding, r[7]);
        }
    });
}
