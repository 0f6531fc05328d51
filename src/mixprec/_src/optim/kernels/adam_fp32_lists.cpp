// adam_fp32_lists.cpp: C++ for optim/cpu_lists.py, which builds it with inductor's toolchain.


// torch.optim.Adam(W)'s for-loop step (and its foreach step, the same ATen ops on the CPU) on fp32 tensors, op for
// op as ATen computes each: mul_ rounds; add with alpha, lerp and addcmul are one fused multiply-add (ATen's explicit
// one, or its compiler's contraction of value * t1 * t2 + self), in the vector loop and the tail alike; the square
// root is the one ATen's sqrt calls (MKL's vmsSqrt, handed in: `root`); division is IEEE. s: AdamW's decay
// (1 - lr * weight_decay) or Adam's weight decay, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps,
// -lr / bias correction 1; flags: 1 decoupled decay, 2 L2 decay, 4 maximize
using Root = void (*)(int, const float*, float*, long long);
constexpr long long ROOT_MODE = 0x2 | 0x100 | 0x140000;  // VML_HA | VML_ERRMODE_IGNORE | VML_FTZDAZ_OFF, as ATen's

inline void adam(float* p, const float* g, float* m, float* v, int64_t first, int64_t last, const float* s,
                 int64_t flags, Root root) {
    const bool decoupled = flags & 1, l2 = flags & 2, maximize = flags & 4;
    const VecF decay(s[0]), beta2(s[2]), omb2(s[3]), bc2(s[4]), eps(s[5]), step(s[6]);
    int64_t k = first;
    for (; k + VecF::size() <= last; k += VecF::size()) {
        VecF pk = VecF::loadu(p + k), gk = VecF::loadu(g + k);
        if (maximize) gk = gk.neg();
        if (decoupled) pk = pk * decay;
        if (l2) gk = at::vec::fmadd(pk, decay, gk);
        vec_lerp(VecF::loadu(m + k), gk, s[1]).store(m + k);
        at::vec::fmadd(omb2 * gk, gk, VecF::loadu(v + k) * beta2).store(v + k);
        pk.store(p + k);
    }
    for (; k < last; ++k) {
        float pk = p[k], gk = maximize ? -g[k] : g[k];
        if (decoupled) pk = pk * s[0];
        if (l2) gk = std::fma(pk, s[0], gk);
        m[k] = lerp(m[k], gk, s[1]);
        v[k] = std::fma(s[3] * gk, gk, v[k] * s[2]);
        p[k] = pk;
    }
    float denom[CHUNK];
    root(static_cast<int>(last - first), v + first, denom, ROOT_MODE);
    k = first;
    for (; k + VecF::size() <= last; k += VecF::size()) {
        const VecF d = VecF::loadu(denom + (k - first)) / bc2 + eps;
        (VecF::loadu(p + k) + step * VecF::loadu(m + k) / d).store(p + k);
    }
    for (; k < last; ++k) {
        const float d = denom[k - first] / s[4] + s[5];
        p[k] = p[k] + s[6] * m[k] / d;
    }
}
}  // namespace

// table: n rows of (weight, gradient, exp_avg, exp_avg_sq, numel)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags, int64_t root) {
    over_chunks(table, n, 5, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        adam(reinterpret_cast<float*>(row[0]), reinterpret_cast<const float*>(row[1]), reinterpret_cast<float*>(row[2]),
             reinterpret_cast<float*>(row[3]), first, last, s, flags, reinterpret_cast<Root>(root));
    });
}
