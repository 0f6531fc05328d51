// adam_fused_lists.cpp: C++ for optim/fused_lists.py, which builds it as cpu_lists' kernels are built.


// torch.optim.Adam(W)'s fused CPU step (fused=True) on fp32 tensors, op for op as torch's fused kernel computes it:
// the decay a multiply (AdamW) or one fused multiply-add into the gradient (Adam's L2), the first moment ATen's lerp
// (one fused multiply-add), the second one fused multiply-add of (1 - beta2) * g by g onto beta2 * v, the root
// correctly rounded, then (-step_size * m) / denom added to the weight. Its tail (the last numel mod 16 values of a
// tensor) is written as that kernel's compiler wrote it: whole groups of 8 as the vector loop, the rest with the
// second moment one fused multiply-add of v by beta2 onto (1 - beta2) * g * g. s: AdamW's decay (1 - lr *
// weight_decay) or Adam's weight decay, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps,
// -lr / bias correction 1; flags: 1 decoupled decay, 2 L2 decay, 4 maximize. A row's sixth column, where not 0, is
// a bf16 copy of the weight written with it (to nearest even, as copy_ writes one: O2's compute copy).

// the tail's width that torch's fused kernel computes as its vector loop
constexpr int64_t TAIL_GROUP = 8;

inline void fused_adam(float* p, const float* g, float* m, float* v, BF16* copy, int64_t first, int64_t last,
                       const float* s, int64_t flags) {
    const bool decoupled = flags & 1, l2 = flags & 2, maximize = flags & 4;
    const VecF decay(s[0]), beta2(s[2]), omb2(s[3]), bc2(s[4]), eps(s[5]), step(s[6]);
    // the vector loop stops where torch's does: at the tensor's last whole 16 values (a chunk holds whole ones)
    const int64_t whole = first + (last - first) / 16 * 16;
    auto vector = [&](int64_t k) {  // the float vector at k: the new weights
        VecF pk = VecF::loadu(p + k), gk = VecF::loadu(g + k);
        if (maximize) gk = gk.neg();
        if (decoupled) pk = pk * decay;
        if (l2) gk = at::vec::fmadd(pk, decay, gk);
        const VecF mk = vec_lerp(VecF::loadu(m + k), gk, s[1]);
        const VecF vk = at::vec::fmadd(omb2 * gk, gk, VecF::loadu(v + k) * beta2);
        mk.store(m + k);
        vk.store(v + k);
        pk = pk + step * mk / (vk.sqrt() / bc2 + eps);
        pk.store(p + k);
        return pk;
    };
    int64_t k = first;
    if (copy != nullptr) {  // two float vectors a time: their copy one whole bf16 vector (a half one is a memcpy)
        for (; k + 2 * VecF::size() <= whole; k += 2 * VecF::size()) {
            const VecF pair[2] = {vector(k), vector(k + VecF::size())};
            store_pair(copy + k, pair);
        }
    }
    for (; k + VecF::size() <= whole; k += VecF::size()) {
        const VecF pk = vector(k);
        if (copy != nullptr) store_vec(copy + k, pk);
    }
    const int64_t grouped = k + (last - k) / TAIL_GROUP * TAIL_GROUP;
    for (; k < last; ++k) {
        float pk = p[k], gk = maximize ? -g[k] : g[k];
        if (decoupled) pk = pk * s[0];
        if (l2) gk = std::fma(pk, s[0], gk);
        const float mk = lerp(m[k], gk, s[1]);
        const float vk = k < grouped ? std::fma(s[3] * gk, gk, v[k] * s[2]) : std::fma(v[k], s[2], s[3] * gk * gk);
        m[k] = mk;
        v[k] = vk;
        pk = pk + s[6] * mk / (std::sqrt(vk) / s[4] + s[5]);
        p[k] = pk;
        if (copy != nullptr) copy[k] = BF16(pk);
    }
}

// the same on bf16 tensors, as torch's fused kernel computes them: in fp32 from the bf16 values, the moments stored
// rounded to bf16 but the update computed from their fp32 values, the weight rounded once; its vector loop takes 32
// values at a time (two float vectors), its tail the rest as above (no copy: bf16 weights have none)
inline void fused_adam(BF16* p, const BF16* g, BF16* m, BF16* v, BF16*, int64_t first, int64_t last, const float* s,
                       int64_t flags) {
    const bool decoupled = flags & 1, l2 = flags & 2, maximize = flags & 4;
    const VecF decay(s[0]), beta2(s[2]), omb2(s[3]), bc2(s[4]), eps(s[5]), step(s[6]);
    const int64_t width = 2 * VecF::size();
    const int64_t whole = first + (last - first) / width * width;
    int64_t k = first;
    for (; k < whole; k += width) {
        VecF pk[2], gk[2], mk[2], vk[2];
        load_pair(p + k, pk);
        load_pair(g + k, gk);
        load_pair(m + k, mk);
        load_pair(v + k, vk);
        for (int h = 0; h < 2; ++h) {
            if (maximize) gk[h] = gk[h].neg();
            if (decoupled) pk[h] = pk[h] * decay;
            if (l2) gk[h] = at::vec::fmadd(pk[h], decay, gk[h]);
            mk[h] = vec_lerp(mk[h], gk[h], s[1]);
            vk[h] = at::vec::fmadd(omb2 * gk[h], gk[h], vk[h] * beta2);
            pk[h] = pk[h] + step * mk[h] / (vk[h].sqrt() / bc2 + eps);
        }
        store_pair(p + k, pk);
        store_pair(m + k, mk);
        store_pair(v + k, vk);
    }
    const int64_t in_groups = k + (last - k) / TAIL_GROUP * TAIL_GROUP;
    for (; k < last; ++k) {
        float pk = static_cast<float>(p[k]), gk = static_cast<float>(g[k]);
        if (maximize) gk = -gk;
        if (decoupled) pk = pk * s[0];
        if (l2) gk = std::fma(pk, s[0], gk);
        const float mk = lerp(static_cast<float>(m[k]), gk, s[1]), v0 = static_cast<float>(v[k]);
        const float vk = k < in_groups ? std::fma(s[3] * gk, gk, v0 * s[2]) : std::fma(v0, s[2], s[3] * gk * gk);
        m[k] = BF16(mk);
        v[k] = BF16(vk);
        p[k] = BF16(pk + s[6] * mk / (std::sqrt(vk) / s[4] + s[5]));
    }
}
}  // namespace

// table: n rows of (weight, gradient, exp_avg, exp_avg_sq, numel, bf16 copy or 0), all %(storage)s but the copy
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags) {
    using T = %(storage)s;
    over_chunks(table, n, 6, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        fused_adam(reinterpret_cast<T*>(row[0]), reinterpret_cast<const T*>(row[1]), reinterpret_cast<T*>(row[2]),
                   reinterpret_cast<T*>(row[3]), reinterpret_cast<BF16*>(row[5]), first, last, s, flags);
    });
}
