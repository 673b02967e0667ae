// Decode attention's shared parts (see cpu_attention.cpp's top): limits, how the cache holds a row,
// the portable loop (attend_one) and, for the SIMD paths, a sequence's rows through its block table.
#pragma once

#include <vector>

#include "cpu_common.h"

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxHeads = 64;  // query heads, for the AVX-512 path's register tiles
constexpr int kSlice = 512;  // positions per slice of a context (whole blocks): shorter ones save less than their merge
constexpr int kMaxSlices = 64;

// How the cache holds one (position, kv head): head_dim values in the model dtype, or, in an int8
// cache, head_dim int8 values followed by their float32 scale (`extra` elements more per head).
template <typename KV> struct CacheRow {
    static constexpr int extra = 0;
    static constexpr bool quantized = false;
    static float scale(const KV*, int) { return 1.f; }
};
template <> struct CacheRow<int8_t> {
    static constexpr int extra = 4;
    static constexpr bool quantized = true;
    static float scale(const int8_t* head, int head_dim) {
        float s;
        std::memcpy(&s, head + head_dim, 4);
        return s;
    }
};

inline float to_f32(int8_t x) { return float(x); }

// The scores of one head after Q.K: soft-capped, and the first `skip` positions (behind the window) masked.
inline void cap_and_mask(float* s, int n, int skip, float softcap) {
    for (int p = 0; p < skip && p < n; ++p) s[p] = -INFINITY;
    if (softcap > 0.f)
        for (int p = skip; p < n; ++p) s[p] = softcap * std::tanh(s[p] / softcap);
}

template <typename T, typename KV>
void attend_one(const T* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int seq_len,
                T* out, int num_kv_heads, int group, int head_dim, int block_size, float scale, int h,
                std::vector<float>& scores, int skip, float softcap) {
    const int D = head_dim, G = group, W = D + CacheRow<KV>::extra;
    const size_t row = size_t(num_kv_heads) * W;  // elements per cache slot
    float qf[kMaxGroup * kMaxHeadDim];
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_f32(q[(h * G + g) * D + d]) * scale;
    scores.resize(size_t(G) * seq_len);
    float mx[kMaxGroup];
    for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
    for (int p0 = 0; p0 < seq_len; p0 += block_size) {
        const KV* kb = k_cache + size_t(table[p0 / block_size]) * block_size * row + size_t(h) * W;
        const int n = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int i = 0; i < n; ++i) {
            const KV* k = kb + i * row;
            const float ks = CacheRow<KV>::scale(k, D);
            for (int g = 0; g < G; ++g) {
                const float* qg = qf + g * D;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int d = 0; d < D; ++d) acc += qg[d] * to_f32(k[d]);
                acc *= ks;
                scores[size_t(g) * seq_len + p0 + i] = acc;
                mx[g] = acc > mx[g] ? acc : mx[g];
            }
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < G; ++g) {
            float* s = scores.data() + size_t(g) * seq_len;
            cap_and_mask(s, seq_len, skip, softcap);
            mx[g] = -INFINITY;
            for (int p = 0; p < seq_len; ++p) mx[g] = s[p] > mx[g] ? s[p] : mx[g];
        }
    float inv[kMaxGroup];
    for (int g = 0; g < G; ++g) {
        float* s = scores.data() + size_t(g) * seq_len;
        float sum = 0.f;
        for (int p = 0; p < seq_len; ++p) { s[p] = std::exp(s[p] - mx[g]); sum += s[p]; }
        inv[g] = 1.f / sum;
    }
    float acc[kMaxGroup * kMaxHeadDim];
    std::memset(acc, 0, sizeof(float) * G * D);
    for (int p0 = 0; p0 < seq_len; p0 += block_size) {
        const KV* vb = v_cache + size_t(table[p0 / block_size]) * block_size * row + size_t(h) * W;
        const int n = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int i = 0; i < n; ++i) {
            const KV* v = vb + i * row;
            const float vs = CacheRow<KV>::scale(v, D);
            for (int g = 0; g < G; ++g) {
                const float w = scores[size_t(g) * seq_len + p0 + i] * vs;
                float* a = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) a[d] += w * to_f32(v[d]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) from_f32(acc[g * D + d] * inv[g], out + (h * G + g) * D + d);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ITERSERVE_SIMD_DECODE 1
// Software prefetch into L2, a row 16 positions ahead of the one being read: scattered blocks
// defeat the hardware prefetcher, and a whole block prefetched at once into L1 runs out of miss
// buffers (measured: K read at ~22 GB/s instead of ~10 over scattered blocks).
inline void prefetch_l2(const void* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T1);
}

// One sequence's cache rows through its block table. fetch<N> gives the K rows of positions p0 ..
// p0 + N - 1 (past the end: the last one; any valid row would do) and prefetches into L2 the rows 16
// positions on: K's, then, past the end of K, V's first ones.
template <typename KV> struct SeqRows {
    const KV *k_cache, *v_cache;
    const int32_t* table;
    int seq_len, block_size;
    size_t row;  // elements per cache slot
    const KV* at(const KV* cache, int p) const {
        return cache + (size_t(table[p / block_size]) * block_size + p % block_size) * row;
    }
    void prefetch(const KV* cache, int p) const { prefetch_l2(at(cache, p), row * sizeof(KV)); }
    void start() const {
        for (int p = 0; p < 16 && p < seq_len; ++p) prefetch(k_cache, p);
    }
    template <int N> void fetch(const KV** rows, int p0) const {
        for (int r = 0; r < N; ++r) {
            rows[r] = at(k_cache, p0 + r < seq_len ? p0 + r : seq_len - 1);
            const int ahead = p0 + r + 16;
            if (ahead < seq_len) prefetch(k_cache, ahead);
            else if (ahead < 2 * seq_len) prefetch(v_cache, ahead - seq_len);
        }
    }
};

#endif

}  // namespace
