// adam_aten_lists.cpp: C++ for optim/aten_lists.py, which builds it as cpu_lists' kernels are built.


// torch.optim.Adam(W)'s for-loop step (and its foreach step, the same ATen ops on the CPU) on fp32 tensors, op for
// op as ATen computes each: mul_ rounds; add with alpha, lerp and addcmul are one fused multiply-add (ATen's explicit
// one, or its compiler's contraction of value * t1 * t2 + self), in the vector loop and the tail alike; the square
// root is the one ATen's sqrt calls (MKL's vmsSqrt, handed in: `root`); division is IEEE. s: AdamW's decay
// (1 - lr * weight_decay) or Adam's weight decay, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps,
// -lr / bias correction 1; flags: 1 decoupled decay, 2 L2 decay, 4 maximize
using Root = void (*)(int, const float*, float*, long long);
constexpr long long ROOT_MODE = 0x2 | 0x100 | 0x140000;  // VML_HA | VML_ERRMODE_IGNORE | VML_FTZDAZ_OFF, as ATen's

// values a part: adam passes over a chunk a part at a time, whose three passes (moments, MKL's root, weights) stay in
// the L1 cache
constexpr int64_t PART = 1024;

inline void adam_part(float* p, const float* g, float* m, float* v, int64_t first, int64_t last, const float* s,
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
    float denom[PART];
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
inline void adam(float* p, const float* g, float* m, float* v, int64_t first, int64_t last, const float* s,
                 int64_t flags, Root root) {
    for (int64_t k = first; k < last; k += PART) adam_part(p, g, m, v, k, std::min(k + PART, last), s, flags, root);
}

// the same ops on bf16 tensors, as ATen computes each on them: in fp32 from the bf16 values, every op's result
// rounded to bf16 (to nearest even); the scalars fp32 but eps, which add_ takes as a bf16 value (s[5] is that);
// the root a correctly rounded fp32 one (ATen's bf16 sqrt computes in fp32 vectors, not MKL's); no L2 decay

inline void adam(BF16* p, const BF16* g, BF16* m, BF16* v, int64_t first, int64_t last, const float* s,
                 int64_t flags, Root) {
    const bool decoupled = flags & 1, maximize = flags & 4;
    const VecF decay(s[0]), beta2(s[2]), omb2(s[3]), bc2(s[4]), eps(s[5]), step(s[6]);
    int64_t k = first;
    for (; k + VecB::size() <= last; k += VecB::size()) {
        VecF pk[2], gk[2], mk[2], vk[2], d[2];
        load_pair(p + k, pk);
        load_pair(g + k, gk);
        load_pair(m + k, mk);
        load_pair(v + k, vk);
        for (int h = 0; h < 2; ++h) {
            if (maximize) gk[h] = gk[h].neg();
            if (decoupled) pk[h] = pk[h] * decay;
            mk[h] = vec_lerp(mk[h], gk[h], s[1]);
            vk[h] = vk[h] * beta2;
        }
        if (decoupled) round_pair(pk);
        round_pair(mk);
        round_pair(vk);
        for (int h = 0; h < 2; ++h) vk[h] = at::vec::fmadd(omb2 * gk[h], gk[h], vk[h]);
        round_pair(vk);
        for (int h = 0; h < 2; ++h) d[h] = vk[h].sqrt();
        round_pair(d);
        for (int h = 0; h < 2; ++h) d[h] = d[h] / bc2;
        round_pair(d);
        for (int h = 0; h < 2; ++h) d[h] = d[h] + eps;
        round_pair(d);
        for (int h = 0; h < 2; ++h) pk[h] = pk[h] + step * mk[h] / d[h];
        store_pair(p + k, pk);
        store_pair(m + k, mk);
        store_pair(v + k, vk);
    }
    for (; k < last; ++k) {
        float pk = static_cast<float>(p[k]), gk = static_cast<float>(g[k]);
        if (maximize) gk = -gk;
        if (decoupled) pk = round_bf16(pk * s[0]);
        const float mk = round_bf16(lerp(static_cast<float>(m[k]), gk, s[1]));
        const float vk = round_bf16(std::fma(s[3] * gk, gk, round_bf16(static_cast<float>(v[k]) * s[2])));
        const float d = round_bf16(round_bf16(round_bf16(std::sqrt(vk)) / s[4]) + s[5]);
        p[k] = BF16(pk + s[6] * mk / d);
        m[k] = BF16(mk);
        v[k] = BF16(vk);
    }
}
}  // namespace

// table: n rows of (weight, gradient, exp_avg, exp_avg_sq, numel), all %(storage)s
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags, int64_t root) {
    using T = %(storage)s;
    over_chunks(table, n, 5, 4, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        adam(reinterpret_cast<T*>(row[0]), reinterpret_cast<const T*>(row[1]), reinterpret_cast<T*>(row[2]),
             reinterpret_cast<T*>(row[3]), first, last, s, flags, reinterpret_cast<Root>(root));
    });
}
