// Decode attention with AVX2 (attend_seq), where there is no AVX-512.
#pragma once

#include <vector>

#include "cpu_attention_decode.h"

namespace {

#if defined(ITERSERVE_SIMD_DECODE) && !defined(__AVX512F__)
// The same computation with AVX2 (8 lanes) for head_dim 64 and 128: 8 positions scored per vector.
// Without bf16 dot products, a bf16 (or int8) cache's K vectors are widened in registers, once for
// up to 3 query heads of their kv head (qk_rows4).

// a[0..7] -> one vector of their 8 horizontal sums, in order.
inline __m256 reduce8(const __m256* a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Q.K of NT query heads (of one kv head) over 4 positions' K rows, 8 dimensions a step: the heads'
// query vectors and the 4 x NT sums stay in registers (12 + 3 + 1 of the 16 at NT = 3), so each K
// vector is loaded and widened once for all NT heads, straight from the cache, and each query vector
// once per 4 rows. Sums per row in dimension order, as one row at a time would give.
template <int D, int NT, typename KV>
inline void qk_rows4(const float* qs, const KV* const* k, __m256 (*partial)[8], int r0) {
    __m256 acc[NT][4];
    for (int c = 0; c < D / 8; ++c) {
        __m256 qv[NT];
        for (int t = 0; t < NT; ++t) qv[t] = _mm256_load_ps(qs + t * D + 8 * c);
        for (int r = 0; r < 4; ++r) {
            const __m256 kv = load8(k[r] + 8 * c);
            for (int t = 0; t < NT; ++t)
                acc[t][r] = c == 0 ? _mm256_mul_ps(qv[t], kv) : _mm256_fmadd_ps(qv[t], kv, acc[t][r]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int r = 0; r < 4; ++r) partial[t][r0 + r] = acc[t][r];
}

// acc[t][0 .. 32) += P.V for NT query heads of one kv head over m positions of a block: dimensions
// c0 .. c0 + 31 of each V row (v, rows `row` apart) widened once for all NT heads, 12 accumulators, 3 broadcast
// probabilities and 1 V vector in the 16 registers. p[t * pstride + i]: head t's probability of the
// block's position i. `ahead` (one tile per block) prefetches V 16 positions on from p0.
template <int D, int NT, typename KV>
inline void pv_rows(const KV* v, int c0, size_t row, int m, const float* p, size_t pstride, float* acc_mem,
                    const SeqRows<KV>* ahead, int p0) {
    __m256 acc[NT][4];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < 4; ++c) acc[t][c] = _mm256_load_ps(acc_mem + t * D + 8 * c);
    for (int i = 0; i < m; ++i, v += row) {
        if (ahead && p0 + i + 16 < ahead->seq_len) ahead->prefetch(ahead->v_cache, p0 + i + 16);
        const float vs = CacheRow<KV>::scale(v, D);  // 1 for a plain cache
        __m256 w[NT];
        for (int t = 0; t < NT; ++t) w[t] = _mm256_set1_ps(p[t * pstride + i] * vs);
        for (int c = 0; c < 4; ++c) {
            const __m256 x = load8(v + c0 + 8 * c);
            for (int t = 0; t < NT; ++t) acc[t][c] = _mm256_fmadd_ps(w[t], x, acc[t][c]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < 4; ++c) _mm256_store_ps(acc_mem + t * D + 8 * c, acc[t][c]);
}

// See the AVX-512 attend_seq: the same passes, the same `part` output for a slice of a split context.
template <int D, typename T, typename KV>
void attend_seq(const T* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int seq_len, T* out,
                int num_kv_heads, int G, int block_size, float scale, std::vector<float>& scores, int skip,
                float softcap, float* part = nullptr) {
    constexpr int W = D + CacheRow<KV>::extra;
    const int H = num_kv_heads * G;
    const size_t row = size_t(num_kv_heads) * W;
    alignas(32) float qs[kMaxHeads * D];  // the queries, scaled, in float32
    for (int i = 0; i < H * D; ++i) qs[i] = to_f32(q[i]) * scale;
    const int padded = (seq_len + 7) & ~7;
    scores.resize(size_t(H) * padded);
    float* s = scores.data();
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    const SeqRows<KV> seq{k_cache, v_cache, table, seq_len, block_size, row};
    seq.start();
    const KV* rows[8];
    __m256 partial[3][8];
    for (int p0 = 0; p0 < seq_len; p0 += 8) {  // 8 positions at a time, one score per lane
        seq.template fetch<8>(rows, p0);
        for (int h = 0; h < num_kv_heads; ++h) {
            const KV* k[8];
            alignas(32) float ks[8];
            for (int r = 0; r < 8; ++r) {
                k[r] = rows[r] + h * W;
                ks[r] = CacheRow<KV>::scale(k[r], D);
            }
            const __m256 row_scale = _mm256_load_ps(ks);
            for (int g0 = h * G; g0 < (h + 1) * G; g0 += 3) {
                const int n = (h + 1) * G - g0 < 3 ? (h + 1) * G - g0 : 3;
                for (int r0 = 0; r0 < 8; r0 += 4) {
                    if (n == 3) qk_rows4<D, 3>(qs + g0 * D, k + r0, partial, r0);
                    else if (n == 2) qk_rows4<D, 2>(qs + g0 * D, k + r0, partial, r0);
                    else qk_rows4<D, 1>(qs + g0 * D, k + r0, partial, r0);
                }
                for (int t = 0; t < n; ++t)
                    _mm256_storeu_ps(s + size_t(g0 + t) * padded + p0, _mm256_mul_ps(reduce8(partial[t]), row_scale));
            }
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < H; ++g) cap_and_mask(s + size_t(g) * padded, seq_len, skip, softcap);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float inv[kMaxHeads];
    for (int g = 0; g < H; ++g) {
        float* sg = s + size_t(g) * padded;
        __m256 top = _mm256_set1_ps(-INFINITY);  // gcc leaves a scalar max loop serial
        for (int p = 0; p < seq_len; p += 8) {  // (x, top): a NaN score is passed over, as the scalar compare does
            const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seq_len - p), lane));
            top = _mm256_max_ps(_mm256_blendv_ps(top, _mm256_loadu_ps(sg + p), valid), top);
        }
        const float max_score = hmax8(top);
        const __m256 mx = _mm256_set1_ps(max_score);
        __m256 sum = _mm256_setzero_ps();
        for (int p = 0; p < seq_len; p += 8) {  // lanes past seq_len are zeroed: padding, not positions
            const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seq_len - p), lane));
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + p), mx)), valid);
            _mm256_storeu_ps(sg + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        const float total = hsum8(sum);
        inv[g] = 1.f / total;
        if (part) {
            part[size_t(H) * D + 2 * g] = max_score;
            part[size_t(H) * D + 2 * g + 1] = total;
        }
    }
    // P.V block by block, as AVX-512 does, in column strips of 32 (pv_rows).
    alignas(32) float acc_mem[kMaxHeads * D];
    for (int i = 0; i < H * D; ++i) acc_mem[i] = 0.f;
    for (int j = 0; j < num_blocks; ++j) {
        const int p0 = j * block_size, m = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int h = 0; h < num_kv_heads; ++h) {
            const KV* vb = v_cache + size_t(table[j]) * block_size * row + h * W;
            for (int c0 = 0; c0 < D; c0 += 32)
                for (int g0 = h * G; g0 < (h + 1) * G; g0 += 3) {
                    const int n = (h + 1) * G - g0 < 3 ? (h + 1) * G - g0 : 3;
                    const SeqRows<KV>* ahead = h == 0 && c0 == 0 && g0 == 0 ? &seq : nullptr;
                    const float* sg = s + size_t(g0) * padded + p0;
                    float* acc = acc_mem + g0 * D + c0;
                    if (n == 3) pv_rows<D, 3>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                    else if (n == 2) pv_rows<D, 2>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                    else pv_rows<D, 1>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                }
        }
    }
    for (int g = 0; g < H; ++g)
        for (int d = 0; d < D; ++d) {
            const float o = acc_mem[g * D + d] * inv[g];
            if (part) part[g * D + d] = o;
            else from_f32(o, out + g * D + d);
        }
}
#endif

}  // namespace
