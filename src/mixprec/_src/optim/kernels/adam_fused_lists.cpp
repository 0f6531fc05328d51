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
    int64_t k = first;
    for (; k + VecF::size() <= whole; k += VecF::size()) {
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
}  // namespace

// table: n rows of (weight, gradient, exp_avg, exp_avg_sq, numel, bf16 copy or 0), all fp32 but the copy
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags) {
    over_chunks(table, n, 6, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        fused_adam(reinterpret_cast<float*>(row[0]), reinterpret_cast<const float*>(row[1]),
                   reinterpret_cast<float*>(row[2]), reinterpret_cast<float*>(row[3]),
                   reinterpret_cast<BF16*>(row[5]), first, last, s, flags);
    });
}
