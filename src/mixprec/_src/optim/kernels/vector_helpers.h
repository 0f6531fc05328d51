// vector_helpers.h: C++ for optim/cpu_adam.py, which builds it with inductor's toolchain.
using VecF = at::vec::Vectorized<float>;
using VecI = at::vec::Vectorized<int32_t>;

inline int32_t bits_of(float x) { int32_t r; std::memcpy(&r, &x, 4); return r; }
inline float from_bits(int32_t r) { float x; std::memcpy(&x, &r, 4); return x; }
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline void store(float* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }  // round to nearest even, as copy_

// ATen's lerp (its vectorized form): one fused multiply-add
inline float lerp(float start, float end, float weight) {
    return std::abs(weight) < 0.5f ? std::fma(weight, end - start, start) : std::fma(weight - 1.0f, end - start, end);
}

inline VecF load_float(const float* x) { return VecF::loadu(x); }
inline VecF load_float(const c10::BFloat16* x) {
    return at::vec::convert<float>(at::vec::Vectorized<c10::BFloat16>::loadu(x, VecF::size()));
}
inline void store_vec(float* p, const VecF& x) { x.store(p); }
inline void store_vec(c10::BFloat16* p, const VecF& x) { at::vec::convert<c10::BFloat16>(x).store(p, VecF::size()); }
inline VecF vec_lerp(const VecF& start, const VecF& end, float weight) {
    return std::abs(weight) < 0.5f ? at::vec::fmadd(VecF(weight), end - start, start)
                                   : at::vec::fmadd(VecF(weight - 1.0f), end - start, end);
}

// sr_noise.sr_bits at flat positions pos, pos + 1, ... (the seed's): fp32 bits with 16 low zeros (exact in bf16)
// (pos + lane) * W + seed == lane * W + (pos * W + seed) in 32-bit wrapping arithmetic: one broadcast a vector, the
// lanes' multiples of W made once
inline VecF vec_sr(const VecF& x, int64_t pos, int64_t seed) {
    static const VecI lanes = VecI::arange(0, 1) * VecI(WEYL);
    const int32_t start = static_cast<int32_t>(static_cast<uint32_t>(pos) * static_cast<uint32_t>(WEYL)
                                               + static_cast<uint32_t>(seed));
    const VecI noise = ((lanes + VecI(start)) >> VecI(16)) & VecI(0xFFFF);
    return at::vec::cast<float>((at::vec::cast<int32_t>(x) + noise) & VecI(-(1 << 16)));
}
inline float sr(float x, int64_t pos, int64_t seed) {
    const int32_t noise = ((int32_t)((uint32_t)pos * (uint32_t)WEYL + (uint32_t)seed) >> 16) & 0xFFFF;
    return from_bits((int32_t)((uint32_t)bits_of(x) + (uint32_t)noise) & -(1 << 16));
}

// two float vectors' worth at once (one whole bf16 vector: a converted half-vector load or store of bf16 costs a
// round trip through memory): the values at x, ..., x + 2 * VecF::size() - 1
using VecB = at::vec::Vectorized<c10::BFloat16>;
inline void load_pair(const float* x, VecF* out) { out[0] = VecF::loadu(x); out[1] = VecF::loadu(x + VecF::size()); }
inline void load_pair(const c10::BFloat16* x, VecF* out) {
    std::tie(out[0], out[1]) = at::vec::convert_to_float<c10::BFloat16>(VecB::loadu(x));
}
inline void store_pair(float* x, const VecF* in) { in[0].store(x); in[1].store(x + VecF::size()); }
inline void store_pair(c10::BFloat16* x, const VecF* in) {  // to nearest even, as store_vec
    at::vec::convert_from_float<c10::BFloat16>(in[0], in[1]).store(x);
}
// a pair rounded to bf16 (to nearest even) and back to fp32 in registers, as ATen rounds each op's result on bf16
inline void round_pair(VecF* x) {
    std::tie(x[0], x[1]) = at::vec::convert_to_float<c10::BFloat16>(at::vec::convert_from_float<c10::BFloat16>(x[0],
                                                                                                            x[1]));
}
inline float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }  // round_pair's scalar
// vec_sr of a pair: the noise of positions pos, ..., pos + 2 * VecF::size() - 1
inline void pair_sr(VecF* x, int64_t pos, int64_t seed) {
    x[0] = vec_sr(x[0], pos, seed);
    x[1] = vec_sr(x[1], pos + VecF::size(), seed);
}

// the new weights at k, ..., written as rounding says: to nearest (0), bf16-sr's noise (1), kahan.write (2), or
// to nearest with a bf16 copy at comp where it is not null (3: an fp32 weight's O2 compute copy, to nearest even, as
// copy_ writes it)
template <typename P>
inline void write_vec(P* p, c10::BFloat16* comp, int64_t k, const VecF& next, int64_t rounding, int64_t seed) {
    if (rounding == 1) {
        store_vec(p + k, vec_sr(next, k, seed));
    } else if (rounding == 2) {
        const VecF w = load_float(p + k);
        const VecF sum = w + ((next - w) + load_float(comp + k));
        store_vec(p + k, sum);
        store_vec(comp + k, sum - load_float(p + k));
    } else {
        store_vec(p + k, next);
        if (rounding == 3 && comp != nullptr) store_vec(comp + k, next);
    }
}
// write_vec of a pair at k, ..., k + 2 * VecF::size() - 1
template <typename P>
inline void write_pair(P* p, c10::BFloat16* comp, int64_t k, VecF* next, int64_t rounding, int64_t seed) {
    if (rounding == 1) {
        pair_sr(next, k, seed);
        store_pair(p + k, next);
    } else if (rounding == 2) {
        VecF w[2], c[2], sum[2];
        load_pair(p + k, w);
        load_pair(comp + k, c);
        for (int h = 0; h < 2; ++h) sum[h] = w[h] + ((next[h] - w[h]) + c[h]);
        store_pair(p + k, sum);
        load_pair(p + k, w);
        for (int h = 0; h < 2; ++h) sum[h] = sum[h] - w[h];
        store_pair(comp + k, sum);
    } else {
        store_pair(p + k, next);
        if (rounding == 3 && comp != nullptr) store_pair(comp + k, next);
    }
}
template <typename P>
inline void write_one(P* p, c10::BFloat16* comp, int64_t k, float next, float w, int64_t rounding, int64_t seed) {
    if (rounding == 1) {
        store(p + k, sr(next, k, seed));
    } else if (rounding == 2) {
        const float sum = w + ((next - w) + static_cast<float>(comp[k]));
        store(p + k, sum);
        comp[k] = c10::BFloat16(sum - to_float(p[k]));
    } else {
        store(p + k, next);
        if (rounding == 3 && comp != nullptr) comp[k] = c10::BFloat16(next);
    }
}

// body(row, first, last) for each chunk [first, last) of each of the n rows of table (width columns; column size_at
// holds the row's size in the units chunked, chunk of them a chunk): the whole list's chunks shared out across the
// cores in one parallel region (a small tensor is not a thread's whole turn, nor a parallel region of its own)
template <typename Body>
inline void over_chunks(const int64_t* table, int64_t n, int64_t width, int64_t size_at, int64_t chunk,
                        const Body& body) {
    std::vector<int64_t> starts(n + 1, 0);  // each row's first chunk in the list's
    for (int64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + (table[width * i + size_at] + chunk - 1) / chunk;
    const int64_t chunks = starts[n];
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = std::upper_bound(starts.begin(), starts.end(), c) - starts.begin() - 1;
        const int64_t* row = table + width * i;
        const int64_t first = (c - starts[i]) * chunk;
        body(row, first, std::min(first + chunk, row[size_at]));
    }
}
