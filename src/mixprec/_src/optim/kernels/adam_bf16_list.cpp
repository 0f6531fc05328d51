// adam_bf16_list.cpp: C++ for optim/cpu_lists.py, which fills its named percent fields and builds it with inductor's toolchain.

// sr_noise.tensor_seed (splitmix64's finaliser over a 64-bit key, a step and an index; the top 32 bits as an int32)
inline int64_t tensor_seed(uint64_t base, uint64_t step, uint64_t index) {
    uint64_t z = base + step * 0x9E3779B97F4A7C15ULL + index * 0xD1B54A32D192ED03ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return static_cast<int32_t>(static_cast<uint32_t>((z ^ (z >> 31)) >> 32));
}

// bf16_state.moment_seed of a row's moment: its tensor_seed, moved to where the row's shard starts (sr_noise.shard_seed:
// r[8] 1, one run of the whole tensor from offset r[9]; 2, another placement, mixed with it; 0, the whole tensor)
inline int64_t moment_seed(int64_t key, int64_t count, const int64_t* r) {
    const int64_t seed = tensor_seed(static_cast<uint64_t>(key), static_cast<uint64_t>(count), static_cast<uint64_t>(r[7]));
    if (r[8] == 1) {
        return static_cast<int32_t>(static_cast<uint32_t>(seed) + static_cast<uint32_t>(r[9]) * static_cast<uint32_t>(WEYL));
    }
    if (r[8] == 2) return tensor_seed(static_cast<uint64_t>(seed), 0, static_cast<uint64_t>(r[9] + 1));
    return seed;
}

// table: n rows of (weight, gradient, compensation or 0, exp_avg, exp_avg_sq, numel, seed, position in the optimizer,
// shard kind, shard offset); the moments' keys (the group's seed and each moment's salt) and the step count
extern "C" void kernel(const int64_t* table, int64_t n, const float* s, int64_t decoupled, int64_t rounding,
                       int64_t m_key, int64_t v_key, int64_t count) {
    over_chunks(table, n, 10, 5, CHUNK, [&](const int64_t* r, int64_t first, int64_t last) {
        update(reinterpret_cast<%(p_type)s*>(r[0]), reinterpret_cast<const %(g_type)s*>(r[1]),
               reinterpret_cast<c10::BFloat16*>(r[2]), reinterpret_cast<c10::BFloat16*>(r[3]),
               reinterpret_cast<c10::BFloat16*>(r[4]), s, first, last, decoupled, rounding, r[6],
               moment_seed(m_key, count, r), moment_seed(v_key, count, r));
    });
}
