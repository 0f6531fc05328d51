// adam_quantized_list.cpp: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

// table: n rows of (weight, gradient, compensation or 0, exp_avg codes, exp_avg scales, exp_avg_sq codes,
// exp_avg_sq scales, numel, blocks, seed)
extern "C" void kernel(const int64_t* table, int64_t n, const float* m_table, const int32_t* m_lookup,
                       const float* v_table, const int32_t* v_lookup, const float* scalars, int64_t m_rows,
                       int64_t v_rows, int64_t decoupled, int64_t rounding) {
    constexpr int64_t chunk_blocks = BLOCK < 4096 ? 4096 / BLOCK : 1;  // about 4096 values a chunk of the list's work
    over_chunks(table, n, 10, 8, chunk_blocks, [&](const int64_t* r, int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            step_block(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
                       reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<uint8_t*>(r[3]),
                       reinterpret_cast<float*>(r[4]), reinterpret_cast<uint8_t*>(r[5]), reinterpret_cast<float*>(r[6]),
                       m_table, m_lookup, v_table, v_lookup, scalars, r[7], b, (int32_t)m_rows, (int32_t)v_rows,
                       decoupled != 0, rounding, r[9]);
        }
    });
}
