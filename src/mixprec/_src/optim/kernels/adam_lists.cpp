// adam_lists.cpp: C++ for optim/cpu_lists.py, which builds it with inductor's toolchain.


// sr_kernel.adam_sr_update / kahan.adam_kahan_update on values [first, last) of one tensor: s holds their nine
// scalars (decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, lr / bias correction 1, 1 / sqrt(bias correction 2), eps)
inline void update(BF16* p, const BF16* g, BF16* m, BF16* v, BF16* comp, int64_t first, int64_t last,
                   const float* s, int64_t rounding, int64_t seed) {
    const VecF decay(s[0]), l2(s[1]), beta1(s[2]), omb1(s[3]), beta2(s[4]), omb2(s[5]), step(s[6]), bc2(s[7]);
    const VecF eps(s[8]);
    int64_t k = first;
    // two float vectors from one whole bf16 vector (a converted half-vector load or store costs a round trip)
    using VecB = at::vec::Vectorized<BF16>;
    for (; k + VecB::size() <= last; k += VecB::size()) {
        VecF pw[2], gw[2], mw[2], vw[2], next[2];
        std::tie(pw[0], pw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(p + k));
        std::tie(gw[0], gw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(g + k));
        std::tie(mw[0], mw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(m + k));
        std::tie(vw[0], vw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(v + k));
        for (int h = 0; h < 2; ++h) {
            const VecF gk = gw[h] + l2 * pw[h];
            mw[h] = mw[h] * beta1 + gk * omb1;
            vw[h] = vw[h] * beta2 + omb2 * gk * gk;
            next[h] = pw[h] * decay - step * mw[h] / (vw[h].sqrt() * bc2 + eps);
        }
        at::vec::convert_from_float<BF16>(mw[0], mw[1]).store(m + k);
        at::vec::convert_from_float<BF16>(vw[0], vw[1]).store(v + k);
        if (rounding == 1) {  // the noise leaves 16 low zero bits: the conversion is exact
            at::vec::convert_from_float<BF16>(vec_sr(next[0], k, seed), vec_sr(next[1], k + VecF::size(), seed))
                .store(p + k);
        } else if (rounding == 2) {  // kahan.write: the sum rounded to nearest, what that dropped kept
            VecF sum[2], back[2], cw[2];
            std::tie(cw[0], cw[1]) = at::vec::convert_to_float<BF16>(VecB::loadu(comp + k));
            for (int h = 0; h < 2; ++h) sum[h] = pw[h] + ((next[h] - pw[h]) + cw[h]);
            const VecB rounded = at::vec::convert_from_float<BF16>(sum[0], sum[1]);
            rounded.store(p + k);
            std::tie(back[0], back[1]) = at::vec::convert_to_float<BF16>(rounded);
            at::vec::convert_from_float<BF16>(sum[0] - back[0], sum[1] - back[1]).store(comp + k);
        } else {
            at::vec::convert_from_float<BF16>(next[0], next[1]).store(p + k);
        }
    }
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
    over_chunks(table, n, 7, 5, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        update(reinterpret_cast<BF16*>(row[0]), reinterpret_cast<const BF16*>(row[1]), reinterpret_cast<BF16*>(row[2]),
               reinterpret_cast<BF16*>(row[3]), reinterpret_cast<BF16*>(row[4]), first, last, s, rounding, row[6]);
    });
}
