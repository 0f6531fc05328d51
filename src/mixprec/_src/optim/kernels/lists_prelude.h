// lists_prelude.h: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int32_t WEYL = -1640531535;
constexpr int64_t CHUNK = 4096;
using BF16 = c10::BFloat16;
%(helpers)s

// body(row, first, last) for each chunk [first, last) of each of the n rows of table (width columns, the tensor's
// number of values in column numel_at)
template <typename Body>
inline void over_chunks(const int64_t* table, int64_t n, int64_t width, int64_t numel_at, const Body& body) {
    std::vector<int64_t> starts(n + 1, 0);  // each tensor's first chunk in the list's
    for (int64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + (table[width * i + numel_at] + CHUNK - 1) / CHUNK;
    const int64_t chunks = starts[n];
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = std::upper_bound(starts.begin(), starts.end(), c) - starts.begin() - 1;
        const int64_t* row = table + width * i;
        const int64_t first = (c - starts[i]) * CHUNK;
        body(row, first, std::min(first + CHUNK, row[numel_at]));
    }
}
