// Causal prompt attention: bf16 on AVX-512 BF16, float32 on AVX2 (see cpu_attention.cpp's top).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Causal attention of one prompt (or chunk) in bf16: T queries at positions S-T .. S-1 over keys
// 0 .. S-1, flash-style (online softmax over steps of up to 64 keys, nothing T x S materialized).
// torch's CPU flash kernel computes every key block even where the causal mask zeroes it; this one
// stops at each query tile's last key. Q.K runs on bf16 pair dot products over 16-key blocks laid out
// pair-interleaved (kt), softmax in float32, P.V on bf16 pair dot products too: probabilities
// rounded to bf16 (as GPU flash attention does), float32 sums. A step of 4 blocks rather than 1 shares
// each broadcast query pair among 4 blocks' dot products and the softmax's reductions, exp and
// rescaling among 64 keys: 1.38x (512 tokens) and 1.44x (2,048) one block a step's time (Zen 4,
// attention_ab.py, docs/performance.md 2026-12-02).
constexpr int kTile = 16;  // queries per work item, keys per block
constexpr int kStep = 4;   // blocks per online-softmax step

// The keys of a 16-key block a query sees: the first `valid` (at or before its position), less the
// first `behind` (before its window).
inline __mmask16 live_keys(int valid, int behind) {
    if (valid <= 0 || behind >= kTile) return 0;
    __mmask16 live = valid >= kTile ? __mmask16(0xffff) : __mmask16((1u << valid) - 1u);
    return behind > 0 ? __mmask16(live & ~((1u << behind) - 1u)) : live;
}

template <int D>
struct PromptScratch {
    std::vector<uint32_t> kt;  // [Hkv][blocks][D/2][16]: key j's bf16 pair (2d, 2d+1) at [d][j]
    std::vector<uint32_t> vp;  // [Hkv][blocks][8][D]: keys 2j and 2j+1's bf16 values of dim d at [j][d]
};

template <int D>
void prompt_tile(const uint16_t* q, int64_t q_stride, uint16_t* out, int T, int S, int H, int G, int h, int tile,
                 float scale, int window, const uint32_t* kt, const uint32_t* vp, std::vector<float>& acc_buf) {
    constexpr int C = D / 16, P = D / 2;
    const int rows = T - tile * kTile < kTile ? T - tile * kTile : kTile, nq = rows * G;
    acc_buf.assign(size_t(nq) * (D + 2), 0.f);
    float* acc = acc_buf.data();        // [nq][D]
    float* m = acc + size_t(nq) * D;     // running max per query vector
    float* l = m + nq;                   // running sum
    for (int i = 0; i < nq; ++i) m[i] = -INFINITY;
    const int first_pos = S - T + tile * kTile;  // absolute position of the tile's first query
    const int num_blocks = (first_pos + rows - 1) / kTile + 1;
    // A windowed layer starts at the step holding the first query's first visible key. Steps start at
    // block numbers that are multiples of kStep for every tile, so a query's sums never depend on its tile.
    const int first_block = (window > 0 ? std::max(0, first_pos - window + 1) / kTile : 0) / kStep * kStep;
    alignas(64) uint32_t pairs[4][8 * kStep];  // this step's probabilities in bf16, two keys per word
    // Up to kStep blocks of 16 keys a step (NB: fewer at the tile's last step, whose further blocks
    // would be past every query of the tile).
    auto step = [&](int b, auto nb) {
        constexpr int NB = decltype(nb)::value;
        const uint32_t* kb = kt + size_t(b) * P * 16;
        const uint32_t* vb = vp + size_t(b) * 8 * D;
        for (int i0 = 0; i0 < nq; i0 += 4) {  // 4 query vectors share each K load
            const int n = nq - i0 < 4 ? nq - i0 : 4;
            const uint32_t* qp[4];
            for (int t = 0; t < 4; ++t) {
                const int i = i0 + (t < n ? t : 0), r = i / G, g = i % G;
                qp[t] = reinterpret_cast<const uint32_t*>(q + (tile * kTile + r) * q_stride + (h * G + g) * D);
            }
            // Each broadcast query pair meets every block's keys: 4 x NB independent chains of dot
            // products, one broadcast per NB of them.
            __m512 sc[4][NB];
            for (int t = 0; t < 4; ++t)
                for (int e = 0; e < NB; ++e) sc[t][e] = _mm512_setzero_ps();
            for (int d = 0; d < P; ++d) {
                __m512bh kk[NB];
                for (int e = 0; e < NB; ++e) kk[e] = (__m512bh)_mm512_loadu_si512(kb + (e * P + d) * 16);
                for (int t = 0; t < 4; ++t) {
                    const __m512bh qq = (__m512bh)_mm512_set1_epi32(int(qp[t][d]));
                    for (int e = 0; e < NB; ++e) sc[t][e] = _mm512_dpbf16_ps(sc[t][e], qq, kk[e]);
                }
            }
            for (int t = 0; t < n; ++t) {
                const int i = i0 + t, pos = first_pos + i / G;
                const int valid = pos - b * kTile + 1;  // keys of block b at or before pos (of b + e: 16 e fewer)
                const int behind = window > 0 ? pos - window + 1 - b * kTile : 0;  // keys before the window
                __mmask16 live[NB];
                bool any = false;
                for (int e = 0; e < NB; ++e) any |= (live[e] = live_keys(valid - e * kTile, behind - e * kTile)) != 0;
                if (!any) {
                    for (int j = 0; j < 8 * NB; ++j) pairs[t][j] = 0;
                    continue;
                }
                const __m512 scl = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
                __m512 x[NB], top = ninf, sum = _mm512_setzero_ps();
                for (int e = 0; e < NB; ++e) top = _mm512_max_ps(top, x[e] = _mm512_mask_mul_ps(ninf, live[e], sc[t][e], scl));
                const float m_new = std::max(m[i], _mm512_reduce_max_ps(top));
                const float corr = std::exp(m[i] - m_new);  // 0 on the first step (m = -inf)
                const __m512 mx = _mm512_set1_ps(m_new);
                for (int e = 0; e < NB; ++e) {
                    const __m512 pr = _mm512_maskz_mov_ps(live[e], exp16(_mm512_sub_ps(x[e], mx)));
                    sum = _mm512_add_ps(sum, pr);
                    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[t] + 8 * e), (__m256i)_mm512_cvtneps_pbh(pr));
                }
                l[i] = l[i] * corr + _mm512_reduce_add_ps(sum);
                m[i] = m_new;
                if (corr != 1.f)
                    for (int c = 0; c < C; ++c)
                        _mm512_storeu_ps(acc + size_t(i) * D + 16 * c,
                                         _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * D + 16 * c), _mm512_set1_ps(corr)));
            }
            __m512 a[4][C];
            for (int t = 0; t < n; ++t)
                for (int c = 0; c < C; ++c) a[t][c] = _mm512_loadu_ps(acc + size_t(i0 + t) * D + 16 * c);
            for (int j = 0; j < 8 * NB; ++j) {  // key pairs, block by block
                __m512bh vv[C];
                for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + j * D + 16 * c);
                for (int t = 0; t < 4; ++t) {
                    if (t >= n) break;
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pairs[t][j]));
                    for (int c = 0; c < C; ++c) a[t][c] = _mm512_dpbf16_ps(a[t][c], w, vv[c]);
                }
            }
            for (int t = 0; t < n; ++t)
                for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + size_t(i0 + t) * D + 16 * c, a[t][c]);
        }
    };
    static_assert(kStep == 4);
    for (int b = first_block; b < num_blocks; b += kStep) {
        switch (std::min(num_blocks - b, kStep)) {
            case 1: step(b, std::integral_constant<int, 1>{}); break;
            case 2: step(b, std::integral_constant<int, 2>{}); break;
            case 3: step(b, std::integral_constant<int, 3>{}); break;
            default: step(b, std::integral_constant<int, 4>{});
        }
    }
    for (int i = 0; i < nq; ++i) {
        const int r = i / G, g = i % G;
        uint16_t* o = out + (size_t(tile * kTile + r) * H + h * G + g) * D;
        for (int d = 0; d < D; ++d) from_f32(acc[size_t(i) * D + d] / l[i], o + d);
    }
}

template <int D>
void prompt_attention(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
                      int64_t v_stride, uint16_t* out, int T, int S, int H, int Hkv, float scale, int num_threads,
                      int window) {
    constexpr int P = D / 2;
    const int G = H / Hkv, nkb = (S + kTile - 1) / kTile, ntiles = (T + kTile - 1) / kTile;
    static thread_local PromptScratch<D> scratch;  // reused across layers and steps
    scratch.kt.resize(size_t(Hkv) * nkb * P * 16);
    scratch.vp.resize(size_t(Hkv) * nkb * 8 * D);
    uint32_t* kt = scratch.kt.data();
    uint32_t* vp = scratch.vp.data();
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < Hkv * nkb; ++item) {  // lay K and V blocks out for the tiles
            const int h = item / nkb, b = item % nkb;
            uint32_t* kd = kt + size_t(item) * P * 16;
            uint32_t* vd = vp + size_t(item) * 8 * D;
            for (int j = 0; j < 16; ++j) {
                const int pos = b * kTile + j;
                const uint16_t* kr = k + pos * k_stride + h * D;
                for (int d = 0; d < P; ++d)
                    kd[d * 16 + j] = pos < S ? uint32_t(kr[2 * d]) | uint32_t(kr[2 * d + 1]) << 16 : 0u;
            }
            for (int j = 0; j < 8; ++j) {
                const int p0 = b * kTile + 2 * j;
                const uint16_t* v0 = v + p0 * v_stride + h * D;
                const uint16_t* v1 = v0 + v_stride;
                for (int d = 0; d < D; ++d)
                    vd[j * D + d] = (p0 < S ? uint32_t(v0[d]) : 0u) | (p0 + 1 < S ? uint32_t(v1[d]) << 16 : 0u);
            }
        }
        std::vector<float> acc_buf;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < Hkv * ntiles; ++item) {  // the longest (last) tiles first
            const int tile = ntiles - 1 - item / Hkv, h = item % Hkv;
            prompt_tile<D>(q, q_stride, out, T, S, H, G, h, tile, scale, window, kt + size_t(h) * nkb * P * 16,
                           vp + size_t(h) * nkb * 8 * D, acc_buf);
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ITERSERVE_PROMPT_F32 1
// The same causal attention in float32 on AVX2 (--dtype float32, and bf16 storage, whose queries are
// float32 and whose K/V the cache's, widened): the flash structure above on 8 lanes, without bf16
// dot products. Both products are the classic AVX2 register tile of 6 rows by 16 columns (12
// accumulators, 2 vector loads and 6 broadcasts a step): Q.K against keys laid out transposed in
// blocks of 16 ([D][16]), P.V against V rows; the online softmax runs a step of 64 keys at a time,
// and a tile of queries stops at its last query's key where torch's flash kernel computes every key
// block. Only where it was measured against torch's kernel (AVX2 CPUs, docs/performance.md): an
// AVX-512 build keeps torch's.
constexpr int kKeyBlock = 16;   // keys per laid-out block of K
constexpr int kStepKeys = 64;   // keys per online-softmax step
constexpr int kQueryRows = 16;  // query positions per work item
constexpr int kRegRows = 6;     // query vectors per register tile

// c[t][0 .. 16) = (Accumulate: c[t] +) sum over i < n of a[t][i] * b[i][0 .. 16), t < 6: Q.K against a
// block of keys laid out [D][16] (a: the queries), and P.V against 16 columns of V rows (a: the
// probabilities). b rows b_stride apart, c rows c_stride apart.
template <bool Accumulate>
inline void tile_6x16(const float* const* a, const float* b, int64_t b_stride, int n, float* c, int64_t c_stride) {
    __m256 acc[kRegRows][2];
    for (int t = 0; t < kRegRows; ++t)
        for (int h = 0; h < 2; ++h)
            acc[t][h] = Accumulate ? _mm256_loadu_ps(c + t * c_stride + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
        const __m256 b0 = _mm256_loadu_ps(b + i * b_stride), b1 = _mm256_loadu_ps(b + i * b_stride + 8);
        for (int t = 0; t < kRegRows; ++t) {
            const __m256 x = _mm256_broadcast_ss(a[t] + i);
            acc[t][0] = _mm256_fmadd_ps(x, b0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(x, b1, acc[t][1]);
        }
    }
    for (int t = 0; t < kRegRows; ++t)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + t * c_stride + 8 * h, acc[t][h]);
}

// Turns query i's scores s[0 .. n) of a step starting at key k0 into probabilities in place (0 outside
// [lo, hi): after its position, or before its window), carrying its running max m, sum l and acc row.
template <int D>
inline void softmax_step(float* s, int n, int lo, int hi, float scale, float& m, float& l, float* acc) {
    if (hi <= lo) {  // no key of this step is visible to the query
        std::fill(s, s + n, 0.f);
        return;
    }
    const __m256 scl = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 top = ninf;
    for (int j = 0; j < n; j += 8) {  // scaled scores, -inf where masked, and their max
        const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
        const __m256 live = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hi), key),
                                                                 _mm256_cmpgt_epi32(key, _mm256_set1_epi32(lo - 1))));
        const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(s + j), scl), live);
        top = _mm256_max_ps(top, x);
        _mm256_storeu_ps(s + j, x);
    }
    const float m_new = std::max(m, hmax8(top));
    const float corr = std::exp(m - m_new);  // 0 on the first step (m = -inf)
    const __m256 mx = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        const __m256 pr = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp8(_mm256_sub_ps(x, mx)));
        sum = _mm256_add_ps(sum, pr);
        _mm256_storeu_ps(s + j, pr);
    }
    l = l * corr + hsum8(sum);
    m = m_new;
    if (corr != 1.f)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), _mm256_set1_ps(corr)));
}

// One work item: query rows tile * 16 .. of kv head h's G query heads. kt: the head's K blocks, vp its
// V rows (zero past S, up to whole blocks).
template <int D>
void prompt_tile_f32(const float* q, int64_t q_stride, float* out, int T, int S, int H, int G, int h, int tile,
                     float scale, int window, const float* kt, const float* vp, std::vector<float>& buf) {
    const int rows = std::min(kQueryRows, T - tile * kQueryRows), nq = rows * G;
    const int np = (nq + kRegRows - 1) / kRegRows * kRegRows;  // whole register tiles: the last padded
    buf.assign(size_t(np) * (D + kStepKeys) + 2 * size_t(np), 0.f);
    float* acc = buf.data();                   // [np][D]
    float* s = acc + size_t(np) * D;           // [np][kStepKeys]: a step's scores, then probabilities
    float* m = s + size_t(np) * kStepKeys;     // running max per query vector
    float* l = m + np;                         // running sum
    std::fill(m, m + np, -INFINITY);
    std::vector<const float*> qp(size_t(np), nullptr);
    for (int i = 0; i < np; ++i) {  // padding rows repeat the last query: finite sums, never stored
        const int r = std::min(i, nq - 1) / G, g = std::min(i, nq - 1) % G;
        qp[i] = q + (tile * kQueryRows + r) * q_stride + (h * G + g) * D;
    }
    const int first_pos = S - T + tile * kQueryRows, end = first_pos + rows;  // the tile sees keys 0 .. end - 1
    // Steps start at fixed multiples of kStepKeys, so a query's sums never depend on its tile or chunk.
    const int start = (window > 0 ? std::max(0, first_pos - window + 1) : 0) / kStepKeys * kStepKeys;
    for (int k0 = start; k0 < end; k0 += kStepKeys) {
        const int n = (std::min(kStepKeys, end - k0) + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        for (int i0 = 0; i0 < np; i0 += kRegRows)
            for (int b = 0; b < n; b += kKeyBlock)
                tile_6x16<false>(qp.data() + i0, kt + size_t(k0 + b) * D, kKeyBlock, D, s + size_t(i0) * kStepKeys + b,
                                 kStepKeys);
        for (int i = 0; i < np; ++i) {
            const int pos = first_pos + std::min(i, nq - 1) / G;
            const int lo = window > 0 ? std::max(0, pos - window + 1 - k0) : 0, hi = std::min(n, pos - k0 + 1);
            softmax_step<D>(s + size_t(i) * kStepKeys, n, lo, hi, scale, m[i], l[i], acc + size_t(i) * D);
        }
        for (int i0 = 0; i0 < np; i0 += kRegRows) {
            const float* pr[kRegRows];
            for (int t = 0; t < kRegRows; ++t) pr[t] = s + size_t(i0 + t) * kStepKeys;
            for (int c = 0; c < D; c += 16)
                tile_6x16<true>(pr, vp + size_t(k0) * D + c, D, n, acc + size_t(i0) * D + c, D);
        }
    }
    for (int i = 0; i < nq; ++i) {
        const int r = i / G, g = i % G;
        float* o = out + (size_t(tile * kQueryRows + r) * H + h * G + g) * D;
        const __m256 inv = _mm256_set1_ps(1.f / l[i]);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + size_t(i) * D + d), inv));
    }
}

template <int D>
void prompt_attention_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                          int64_t v_stride, float* out, int T, int S, int H, int Hkv, float scale, int num_threads,
                          int window) {
    const int G = H / Hkv, nkb = (S + kKeyBlock - 1) / kKeyBlock, ntiles = (T + kQueryRows - 1) / kQueryRows;
    static thread_local std::vector<float> kt_buf, vp_buf;  // reused across layers and steps
    kt_buf.resize(size_t(Hkv) * nkb * kKeyBlock * D);
    vp_buf.resize(size_t(Hkv) * nkb * kKeyBlock * D);
    float* kt = kt_buf.data();  // [Hkv][blocks][D][16]: key j of a block, dim d at [d][j]
    float* vp = vp_buf.data();  // [Hkv][blocks * 16][D]: V rows, zero past S
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < Hkv * nkb; ++item) {  // lay K and V blocks out for the tiles
            const int h = item / nkb, b = item % nkb;
            float* kd = kt + size_t(item) * kKeyBlock * D;
            float* vd = vp + size_t(item) * kKeyBlock * D;
            for (int j = 0; j < kKeyBlock; ++j) {
                const int pos = b * kKeyBlock + j;
                const float* kr = k + pos * k_stride + h * D;
                const float* vr = v + pos * v_stride + h * D;
                for (int d = 0; d < D; ++d) {
                    kd[d * kKeyBlock + j] = pos < S ? kr[d] : 0.f;
                    vd[j * D + d] = pos < S ? vr[d] : 0.f;
                }
            }
        }
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < Hkv * ntiles; ++item) {  // the longest (last) tiles first
            const int tile = ntiles - 1 - item / Hkv, h = item % Hkv;
            prompt_tile_f32<D>(q, q_stride, out, T, S, H, G, h, tile, scale, window,
                               kt + size_t(h) * nkb * kKeyBlock * D, vp + size_t(h) * nkb * kKeyBlock * D, buf);
        }
    }
}
#endif

}  // namespace
