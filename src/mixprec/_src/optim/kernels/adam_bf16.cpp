// adam_bf16.cpp: C++ for optim/cpu_adam.py, which fills its named percent fields and builds it with inductor's toolchain.

#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Adam(W) with bf16 moments rounded stochastically (step.bf16_state): adam.adam_update's arithmetic, operation
// for operation (the quantized kernel's), each moment written with sr_noise.sr_bits' noise of its own seed
namespace {
constexpr int32_t WEYL = -1640531535;
constexpr int64_t CHUNK = 4096;
%(helpers)s

// the step of values [first, last) of one tensor (first a multiple of CHUNK)
inline void update(%(p_type)s* p, const %(g_type)s* g, c10::BFloat16* comp, c10::BFloat16* m, c10::BFloat16* v,
                   const float* s, int64_t first, int64_t last, int64_t decoupled, int64_t rounding, int64_t seed,
                   int64_t m_seed, int64_t v_seed) {
    const VecF lr(s[0]), decay(s[1]), bc1(s[4]), bc2(s[5]), eps(s[6]);
    int64_t k = first;
    for (; k + 2 * VecF::size() <= last; k += 2 * VecF::size()) {  // the loop below's, two vectors at a time
        VecF pk[2], gk[2], mk[2], vk[2], next[2];
        load_pair(p + k, pk);
        load_pair(g + k, gk);
        load_pair(m + k, mk);
        load_pair(v + k, vk);
        for (int h = 0; h < 2; ++h) {
            if (decoupled) pk[h] = pk[h] - decay * pk[h];
            else gk[h] = gk[h] + decay * pk[h];
            mk[h] = vec_lerp(mk[h], gk[h], s[2]);
            vk[h] = vec_lerp(vk[h], gk[h] * gk[h], s[3]);
            next[h] = pk[h] - (lr * (mk[h] / bc1)) / (vk[h].sqrt() / bc2 + eps);
        }
        pair_sr(mk, k, m_seed);
        pair_sr(vk, k, v_seed);
        store_pair(m + k, mk);
        store_pair(v + k, vk);
        write_pair(p, comp, k, next, rounding, seed);
    }
    for (; k + VecF::size() <= last; k += VecF::size()) {
        VecF pk = load_float(p + k), gk = load_float(g + k);
        if (decoupled) pk = pk - decay * pk;
        else gk = gk + decay * pk;
        const VecF mk = vec_lerp(load_float(m + k), gk, s[2]);
        const VecF vk = vec_lerp(load_float(v + k), gk * gk, s[3]);
        store_vec(m + k, vec_sr(mk, k, m_seed));
        store_vec(v + k, vec_sr(vk, k, v_seed));
        write_vec(p, comp, k, pk - (lr * (mk / bc1)) / (vk.sqrt() / bc2 + eps), rounding, seed);
    }
    for (; k < last; ++k) {
        const float w = to_float(p[k]);
        float pk = w, gk = to_float(g[k]);
        if (decoupled) pk = pk - s[1] * pk;
        else gk = gk + s[1] * pk;
        const float mk = lerp(to_float(m[k]), gk, s[2]), vk = lerp(to_float(v[k]), gk * gk, s[3]);
        m[k] = c10::BFloat16(sr(mk, k, m_seed));
        v[k] = c10::BFloat16(sr(vk, k, v_seed));
        write_one(p, comp, k, pk - (s[0] * (mk / s[4])) / (std::sqrt(vk) / s[5] + s[6]), w, rounding, seed);
    }
}
}  // namespace

extern "C" void kernel(%(p_type)s* p, const %(g_type)s* g, c10::BFloat16* comp, c10::BFloat16* m,
                       c10::BFloat16* v, const float* s, int64_t numel, int64_t decoupled, int64_t rounding,
                       int64_t seed, int64_t m_seed, int64_t v_seed) {
    const int64_t chunks = (numel + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * CHUNK, last = first + CHUNK < numel ? first + CHUNK : numel;
        update(p, g, comp, m, v, s, first, last, decoupled, rounding, seed, m_seed, v_seed);
    }
}
