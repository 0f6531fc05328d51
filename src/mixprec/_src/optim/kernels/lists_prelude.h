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
