// step_counts.cpp: C++ for optim/cpu_lists.py (host_counts' step tensors), which builds it with inductor's toolchain.
}  // namespace

// each of the n fp32 scalars at addresses[i] set to values[i]: an optimizer's step counts written in one call
extern "C" void kernel(const int64_t* addresses, const float* values, int64_t n) {
    for (int64_t i = 0; i < n; ++i) *reinterpret_cast<float*>(addresses[i]) = values[i];
}
