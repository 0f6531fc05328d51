// sgd_bf16_state.cpp: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

// SGD with a bf16 momentum buffer rounded stochastically (step.bf16_state.sgd_step): optim.sgd.sgd_update's
// arithmetic (ATen's add with alpha: one fused multiply-add), the buffer written with its own seed's noise

// s: weight decay, momentum, 1 - dampening, -lr; nesterov
inline void sgd(%(p_type)s* p, const %(g_type)s* g, BF16* buf, BF16* comp, int64_t first, int64_t last, const float* s,
                bool nesterov, bool started, int64_t rounding, int64_t seed, int64_t buf_seed) {
    const VecF wd(s[0]), m(s[1]), damp(s[2]), neg_lr(s[3]);
    int64_t k = first;
    for (; k + 2 * VecF::size() <= last; k += 2 * VecF::size()) {  // the loop below's, two vectors at a time
        VecF pk[2], gk[2], b[2], next[2];
        load_pair(p + k, pk);
        load_pair(g + k, gk);
        if (started) load_pair(buf + k, b);
        for (int h = 0; h < 2; ++h) {
            if (s[0] != 0.0f) gk[h] = at::vec::fmadd(pk[h], wd, gk[h]);
            b[h] = started ? at::vec::fmadd(gk[h], damp, b[h] * m) : gk[h];
            const VecF d = nesterov ? at::vec::fmadd(b[h], m, gk[h]) : b[h];
            next[h] = at::vec::fmadd(d, neg_lr, pk[h]);
        }
        pair_sr(b, k, buf_seed);
        store_pair(buf + k, b);
        write_pair(p, comp, k, next, rounding, seed);
    }
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
    over_chunks(table, n, 8, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        sgd(reinterpret_cast<%(p_type)s*>(row[0]), reinterpret_cast<const %(g_type)s*>(row[1]),
            reinterpret_cast<BF16*>(row[2]), reinterpret_cast<BF16*>(row[3]), first, last, s, nesterov != 0,
            row[7] != 0, rounding, row[5], row[6]);
    });
}
