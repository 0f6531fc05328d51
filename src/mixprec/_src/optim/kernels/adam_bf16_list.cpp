// adam_bf16_list.cpp: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

// table: n rows of (weight, gradient, compensation or 0, exp_avg, exp_avg_sq, numel, seed, exp_avg's seed,
// exp_avg_sq's seed)
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t decoupled, int64_t rounding) {
    over_chunks(table, n, 9, 5, CHUNK, [&](const int64_t* r, int64_t first, int64_t last) {
        update(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
               reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<c10::BFloat16*>(r[3]),
               reinterpret_cast<c10::BFloat16*>(r[4]), s, first, last, decoupled, rounding, r[6], r[7], r[8]);
    });
}
