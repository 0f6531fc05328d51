// square_norm.cpp: C++ for optim/cpu_adam.py, which fills its named percent fields and builds it with inductor's toolchain.

#include <torch/csrc/inductor/cpp_prefix.h>
#include <vector>

#define LIST %(list)s
using X = %(x_type)s;

// the sum of squares of n low-precision values in fp32: fixed chunks (so the sum is the same whatever the
// threads), each summed in vector lanes, the lanes and then the chunks added in order
inline float sum_of_squares(const X* x, int64_t n) {
    using VecF = at::vec::Vectorized<float>;
    constexpr int64_t CHUNK = 1 << 16;
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    std::vector<float> partial(chunks);
    #pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * CHUNK, last = first + CHUNK < n ? first + CHUNK : n;
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
        partial[c] = sum;
    }
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += partial[c];
    return total;
}

#if LIST
// n rows of (address, number of values): each tensor's sum of squares into out[i], in one call. Where no row has
// more than one chunk, the rows are shared out across the threads (each row's sum is one thread's, in its order);
// else a row at a time, its chunks shared out: the same sums either way
extern "C" void kernel(const int64_t* table, float* out, int64_t n) {
    bool one_chunk = true;
    for (int64_t i = 0; i < n; ++i) one_chunk = one_chunk && table[2 * i + 1] <= (int64_t{1} << 16);
    #pragma omp parallel for schedule(dynamic, 1) if (one_chunk && n > 1)
    for (int64_t i = 0; i < n; ++i) out[i] = sum_of_squares(reinterpret_cast<const X*>(table[2 * i]), table[2 * i + 1]);
}
#else
extern "C" void kernel(const X* x, float* out, int64_t n) { out[0] = sum_of_squares(x, n); }
#endif
