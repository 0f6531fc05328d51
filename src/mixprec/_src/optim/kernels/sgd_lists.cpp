// sgd_lists.cpp: C++ for optim/cpu_lists.py, which builds it with inductor's toolchain.


// torch.optim.SGD's for-loop step (and its foreach step, the same ATen ops on the CPU) on fp32 values, as ATen
// computes it (add with alpha is one fused multiply-add, in its vector loop and its tail alike; mul rounds): on fp32
// tensors, or on bf16 ones as on their fp32 copies, the momentum buffer stored back to nearest; s: weight decay,
// momentum, 1 - dampening, -lr; flags: 1 nesterov, 2 maximize, 4 momentum
template <typename T>
inline void sgd(T* p, const T* g, T* buf, BF16* comp, int64_t first, int64_t last, const float* s,
                int64_t flags, bool started, int64_t rounding, int64_t seed) {
    const bool nesterov = flags & 1, maximize = flags & 2, momentum = flags & 4;
    const VecF wd(s[0]), m(s[1]), damp(s[2]), neg_lr(s[3]);
    int64_t k = first;
    for (; k + 2 * VecF::size() <= last; k += 2 * VecF::size()) {  // the loop below's, two vectors at a time
        VecF pk[2], gk[2], b[2], next[2];
        load_pair(p + k, pk);
        load_pair(g + k, gk);
        if (momentum && started) load_pair(buf + k, b);
        for (int h = 0; h < 2; ++h) {
            if (maximize) gk[h] = gk[h].neg();
            if (s[0] != 0.0f) gk[h] = at::vec::fmadd(pk[h], wd, gk[h]);
            if (momentum) {
                b[h] = started ? at::vec::fmadd(gk[h], damp, b[h] * m) : gk[h];
                gk[h] = nesterov ? at::vec::fmadd(b[h], m, gk[h]) : b[h];
            }
            next[h] = at::vec::fmadd(gk[h], neg_lr, pk[h]);
        }
        if (momentum) store_pair(buf + k, b);
        write_pair(p, comp, k, next, rounding, seed);
    }
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
    over_chunks(table, n, 7, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        using T = %(storage)s;  // BF16 or float
        sgd(reinterpret_cast<T*>(row[0]), reinterpret_cast<const T*>(row[1]), reinterpret_cast<T*>(row[2]),
            reinterpret_cast<BF16*>(row[3]), first, last, s, flags, row[6] != 0, rounding, row[5]);
    });
}
