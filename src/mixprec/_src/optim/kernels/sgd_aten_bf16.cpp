// sgd_aten_bf16.cpp: C++ for optim/aten_lists.py, which builds it as cpu_lists' kernels are built.


// torch.optim.SGD's for-loop and foreach steps on bf16 tensors, op for op as ATen computes each on them. ATen's
// bf16 add with alpha (alpha rounded to bf16) adds other * alpha (exact in fp32) to self and rounds once in its vector
// loop, but rounds the product to bf16 first in its scalar tail: the last (length mod the bf16 vector's width)
// values of each thread's share of the tensor (at::parallel_for: a tensor of GRAIN values or more split into equal
// shares, one a thread). mul_ by momentum rounds once (the for-loop's fp32 momentum; foreach's, rounded to bf16,
// handed in so). s: weight decay, momentum (as mul_ applies it), 1 - dampening, -lr, momentum (the alphas: bf16
// values); flags:
// 1 nesterov, 2 maximize, 4 momentum; threads: torch's intra-op threads; width: ATen's bf16 vector width.

constexpr int64_t GRAIN = 32768;  // at::internal::GRAIN_SIZE

// self + other * alpha as ATen's bf16 add computes it at a value of its vector loop (vec) or of its tail
inline float add_alpha(float self, float other, float alpha, bool tail) {
    return tail ? round_bf16(self + round_bf16(other * alpha)) : round_bf16(self + other * alpha);
}
// the same at a pair of its vector loop's float vectors, into out (which may be self or other)
inline void add_alpha(VecF* out, const VecF* self, const VecF* other, const VecF& alpha) {
    out[0] = self[0] + other[0] * alpha;
    out[1] = self[1] + other[1] * alpha;
    round_pair(out);
}

struct Step {
    const float* s;
    bool nesterov, maximize, momentum, started;
};

// one value (tail or not)
inline void sgd_one(BF16* p, const BF16* g, BF16* buf, int64_t k, const Step& st, bool tail) {
    const float* s = st.s;
    float gk = static_cast<float>(g[k]), pk = static_cast<float>(p[k]);
    if (st.maximize) gk = -gk;
    if (s[0] != 0.0f) gk = add_alpha(gk, pk, s[0], tail);
    if (st.momentum) {
        float b = gk;
        if (st.started) b = add_alpha(round_bf16(static_cast<float>(buf[k]) * s[1]), gk, s[2], tail);
        buf[k] = BF16(b);
        gk = st.nesterov ? add_alpha(gk, b, s[4], tail) : b;
    }
    p[k] = BF16(add_alpha(pk, gk, s[3], tail));
}
// two float vectors of values (one whole bf16 vector; never a tail's)
inline void sgd_pair(BF16* p, const BF16* g, BF16* buf, int64_t k, const Step& st) {
    const float* s = st.s;
    VecF gk[2], pk[2];
    load_pair(g + k, gk);
    load_pair(p + k, pk);
    if (st.maximize) gk[0] = gk[0].neg(), gk[1] = gk[1].neg();
    if (s[0] != 0.0f) add_alpha(gk, gk, pk, VecF(s[0]));
    if (st.momentum) {
        VecF b[2] = {gk[0], gk[1]};
        if (st.started) {
            VecF m[2];
            load_pair(buf + k, m);
            m[0] = m[0] * VecF(s[1]);
            m[1] = m[1] * VecF(s[1]);
            round_pair(m);
            add_alpha(b, m, gk, VecF(s[2]));
        }
        store_pair(buf + k, b);
        if (st.nesterov) add_alpha(gk, gk, b, VecF(s[4]));
        else gk[0] = b[0], gk[1] = b[1];
    }
    VecF out[2];
    add_alpha(out, pk, gk, VecF(s[3]));
    store_pair(p + k, out);
}

// the values [first, last) of a tensor of n values, each as ATen computes it where it falls
inline void sgd(BF16* p, const BF16* g, BF16* buf, int64_t n, int64_t first, int64_t last, const Step& st,
                int64_t threads, int64_t width) {
    const int64_t shares = (n < GRAIN || threads <= 1) ? 1 : std::min(threads, (n + GRAIN - 1) / GRAIN);
    const int64_t share = (n + shares - 1) / shares;
    int64_t k = first;
    while (k < last) {
        const int64_t start = k / share * share, end = std::min(n, start + share);  // the share k falls in
        const int64_t tail = start + (end - start) / width * width;  // its tail's first value
        const int64_t upto = std::min(last, tail);
        for (; k + 2 * VecF::size() <= upto; k += 2 * VecF::size()) sgd_pair(p, g, buf, k, st);
        for (; k < upto; ++k) sgd_one(p, g, buf, k, st, false);
        for (; k < std::min(last, end); ++k) sgd_one(p, g, buf, k, st, true);
    }
}
}  // namespace

// table: n rows of (weight, gradient, momentum buffer or 0, numel, buffer started), all bf16
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t flags, int64_t threads,
                       int64_t width) {
    over_chunks(table, n, 5, 3, CHUNK, [&](const int64_t* row, int64_t first, int64_t last) {
        const Step st{s, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0, row[4] != 0};
        sgd(reinterpret_cast<BF16*>(row[0]), reinterpret_cast<const BF16*>(row[1]), reinterpret_cast<BF16*>(row[2]),
            row[3], first, last, st, threads, width);
    });
}
