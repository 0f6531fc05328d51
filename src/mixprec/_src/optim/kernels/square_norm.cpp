// square_norm.cpp: C++ for optim/cpu_adam.py, which fills its named percent fields and builds it with inductor's toolchain.

#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <vector>

#define LIST %(list)s
using X = %(x_type)s;

constexpr int64_t CHUNK = 1 << 16;

// the sum of squares of x[first, last) in fp32: summed in vector lanes, the lanes added in order, then the tail
inline float chunk_sum(const X* x, int64_t first, int64_t last) {
    using VecF = at::vec::Vectorized<float>;
    VecF acc(0.0f);
    int64_t i = first;
    for (; i + VecF::size() <= last; i += VecF::size()) {
        const VecF v = at::vec::convert<float>(at::vec::Vectorized<X>::loadu(x + i, VecF::size()));
        acc = at::vec::fmadd(v, v, acc);
    }
    alignas(64) float lanes[VecF::size()];
    acc.store(lanes);
    float sum = 0.0f;
    for (int64_t j = 0; j < VecF::size(); ++j) sum += lanes[j];
    for (; i < last; ++i) { const float v = static_cast<float>(x[i]); sum += v * v; }
    return sum;
}

// the sum of squares of n low-precision values in fp32: fixed chunks (so the sum is the same whatever the
// threads), each chunk_sum'd, the chunks added in order
inline float sum_of_squares(const X* x, int64_t n) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<float> partial(chunks);
    #pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) partial[c] = chunk_sum(x, c * CHUNK, std::min(c * CHUNK + CHUNK, n));
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += partial[c];
    return total;
}

#if LIST
// n rows of (address, number of values): each tensor's sum of squares into out[i], in one call: every row's chunks
// (as sum_of_squares cuts them) shared out across the threads in one parallel region, then each row's chunks added
// in order: sum_of_squares' sums, bit for bit, whatever the rows' sizes
extern "C" void kernel(const int64_t* table, float* out, int64_t n) {
    std::vector<int64_t> starts(n + 1, 0);  // each row's first chunk in the list's
    for (int64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + (table[2 * i + 1] + CHUNK - 1) / CHUNK;
    const int64_t chunks = starts[n];
    std::vector<float> partial(chunks);
    #pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = std::upper_bound(starts.begin(), starts.end(), c) - starts.begin() - 1;
        const int64_t first = (c - starts[i]) * CHUNK, size = table[2 * i + 1];
        partial[c] = chunk_sum(reinterpret_cast<const X*>(table[2 * i]), first, std::min(first + CHUNK, size));
    }
    for (int64_t i = 0; i < n; ++i) {
        float total = 0.0f;
        for (int64_t c = starts[i]; c < starts[i + 1]; ++c) total += partial[c];
        out[i] = total;
    }
}
#else
extern "C" void kernel(const X* x, float* out, int64_t n) { out[0] = sum_of_squares(x, n); }
#endif
