// Weight-only int8 and int4 linear layers on AVX2 (linear_int8_weights, linear_int4_weights).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_linear_avx2.h"

namespace {

#if defined(ITERSERVE_LINEAR) && !defined(__AVX512F__)
#define ITERSERVE_LINEAR_WEIGHT_ONLY 1
// Weight-only int8 (--quantization int8) on AVX2, summed in integers: AVX2 has no int8 dot product that
// keeps 8-bit activations exact (vpmaddubsw saturates u8 x s8 pairs), but vpmaddwd multiplies 16-bit
// pairs into int32 exactly: 16 multiply-adds an instruction, twice a float32 FMA's 8. So x enters as
// 16-bit codes, one symmetric scale a row (|error| <= max|x| / 65534, far below the weights' int8
// rounding), and a panel holds its codes in pairs of k, pairs[Kp / 2][kPanel][2] (Kp: K rounded up to
// even, zero-padded); every output's float32 scale follows the last panel. The int32 sums of
// kChunkPairs pairs stay below 2^31 (256 x 2 x 32767 x 127 = 2,130,641,408); each chunk's go into
// float32 ones.
constexpr int64_t kChunkPairs = 256;

inline int64_t pair_depth(int64_t K) { return (K + 1) / 2 * 2; }

// One row of x -> Kp 16-bit codes (the padding's are 0) and its scale. A NaN anywhere in the row makes the
// scale NaN (and the codes 0), so the row's outputs are NaN, as a float product's would be.
void quantize_row16(const float* x, int64_t K, int16_t* q, float* scale) {
    __m256 hi = _mm256_setzero_ps(), nan = hi;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        hi = _mm256_max_ps(hi, _mm256_andnot_ps(sign, v));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float amax = 0.0f;
    float lanes[8];
    _mm256_storeu_ps(lanes, hi);
    for (float v : lanes) amax = std::max(amax, v);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = k; j < K; ++j) amax = std::max(amax, std::fabs(x[j])), has_nan |= std::isnan(x[j]);
    const float s = has_nan ? NAN : amax > 0.0f ? amax / 32767.0f : 1.0f, inv = has_nan ? 0.0f : 1.0f / s;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= K; k += 8) {  // cvtps rounds to nearest even, as nearbyint does; |code| <= 32767
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                         _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    }
    for (; k < K; ++k) q[k] = int16_t(std::clamp(std::nearbyint(x[k] * inv), -32767.0f, 32767.0f));
    if (K % 2) q[K] = 0;
    *scale = s;
}

// acc + vpmaddwd(x, w), in asm, as dpbusd above: with the intrinsics GCC 12 broadcasts a 6-row tile's x
// ahead, which leaves no register for the 12 accumulators, and spills them to the stack every k pair.
inline __m256i broadcast_pair(const int16_t* p) {
    __m256i v;
    asm("vpbroadcastd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const int32_t*>(p)));
    return v;
}
inline __m256i madd_add(__m256i acc, __m256i x, __m256i w) {
    __m256i t;
    asm("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(x), "x"(w));
    return acc;
}

// What an int8 tile reads: its rows' codes (ldq apart) and scales, one panel and its outputs' scales.
struct Int8Rows {
    const int16_t* xq;
    int64_t ldq;
    const float* xs;
    const int8_t* w;
    int64_t Kp;
    const float* wscale;
};

// y[R rows, columns C0 .. C0 + 8V] = the rows' codes . the panel's (int32 sums, float32 per chunk), times
// each row's and each output's scale (+ bias). Each k pair is one 32-bit broadcast of x and, per 8
// outputs, a sign-extending load of 16 codes.
template <int R, int V, int C0>
inline void weight_only_tile(const Int8Rows& t, float* y, int64_t ldy, int valid, const float* bias) {
    const auto [xq, ldq, xs, w, Kp, wscale] = t;
    __m256 f[R][V];
    zero_tile(f);
    for (int64_t c0 = 0; c0 < Kp / 2; c0 += kChunkPairs) {
        __m256i a[R][V];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) a[r][v] = _mm256_setzero_si256();
        const int64_t end = std::min(c0 + kChunkPairs, Kp / 2);
        for (int64_t i = c0; i < end; ++i) {
            const int8_t* wi = w + i * 2 * kPanel;
            _mm_prefetch(reinterpret_cast<const char*>(wi) + kPrefetch, _MM_HINT_T0);
            __m256i wv[V];
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v)
                wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi + 2 * (C0 + 8 * v))));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m256i xb = broadcast_pair(xq + r * ldq + 2 * i);
#pragma GCC unroll 4
                for (int v = 0; v < V; ++v) a[r][v] = madd_add(a[r][v], xb, wv[v]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) f[r][v] = _mm256_add_ps(f[r][v], _mm256_cvtepi32_ps(a[r][v]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(xs[r]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v)
            f[r][v] = _mm256_mul_ps(f[r][v], _mm256_mul_ps(s, _mm256_loadu_ps(wscale + C0 + 8 * v)));
    }
    store_columns(f, y, ldy, valid, bias);
}

// A tile of 1 .. kRows rows of either weight-only kernel (Rows: Int8Rows or Int4Rows). Up to 2 rows take the
// panel's 32 columns in one pass (8 accumulators, 4 weight vectors), 3-6 in two passes of 16 (12
// accumulators, 2 weight vectors, 1 broadcast), as the float tiles.
template <int R = 1, typename Rows>
void weight_only_rows(int rows, const Rows& t, float* y, int64_t ldy, int valid, const float* bias) {
    if (rows != R) {
        if constexpr (R < kRows) weight_only_rows<R + 1>(rows, t, y, ldy, valid, bias);
    } else if constexpr (R <= 2) {
        weight_only_tile<R, 4, 0>(t, y, ldy, valid, bias);
    } else {
        weight_only_tile<R, 2, 0>(t, y, ldy, std::min(valid, 16), bias);
        if (valid > 16) weight_only_tile<R, 2, 16>(t, y + 16, ldy, valid - 16, bias ? bias + 16 : nullptr);
    }
}

// x [M, K] (rows ldx apart) @ (codes * scales)^T (+ bias) -> y [M, N]: the rows quantized first (split
// across the threads), then each thread takes a run of panels, tile by tile (rows of near-equal height).
void linear_int8_weights(const float* x, int64_t ldx, const int8_t* panels, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, int num_threads) {
    const int64_t Kp = pair_depth(K), num_panels = (N + kPanel - 1) / kPanel;
    const float* wscale = reinterpret_cast<const float*>(panels + num_panels * Kp * kPanel);
    static thread_local std::vector<int16_t> codes;
    static thread_local std::vector<float> scales;
    codes.resize(size_t(M * Kp)), scales.resize(size_t(M));
    int16_t* q = codes.data();
    float* xs = scales.data();
    quantized_rows_then_panels(
        M, N, kRows, num_threads, [&](int64_t m) { quantize_row16(x + m * ldx, K, q + m * Kp, xs + m); },
        [&](int64_t p, int64_t m0, int rows, int64_t n0, int valid) {
            weight_only_rows(rows, Int8Rows{q + m0 * Kp, Kp, xs + m0, panels + p * Kp * kPanel, Kp, wscale + n0},
                             y + m0 * N + n0, N, valid, bias ? bias + n0 : nullptr);
        });
}

// Weight-only int4 (--quantization int4) on AVX2, summed in integers as int8 is: Q4_1's scheme, w = q * scale
// + minimum with q in [0, 15], a bf16 scale and minimum per group of kInt4Group inputs and output, 0.625
// bytes a weight in one forward stream. A panel is K / kInt4Group groups, each its codes in pairs of k,
// 32 bytes a pair (byte j: column j's code at the even k in the low nibble, at the odd k in the high one),
// then the group's kPanel scales and kPanel minimums. Per pair, 16 columns' bytes are split into nibbles
// and interleaved (unpack) into the 16-bit pairs vpmaddwd takes; a group's int32 sums s (|s| <= 32 x 15
// x 32767) then go into float32 ones: y = x_scale * sum_g (scale_g * s_g + minimum_g * (x's codes summed
// over g)) + bias.

// 16 columns' codes at one pair of k (16 bytes) -> the 16-bit pairs of columns 0-7 and of 8-15.
inline void int4_pairs(const uint8_t* bytes, __m256i& w0, __m256i& w1) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), nibble = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
    w0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
    w1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo, hi));
}

// What an int4 tile reads: its rows' codes (ldq apart), scales and per-group code sums, and one panel.
struct Int4Rows {
    const int16_t* xq;
    int64_t ldq;
    const float* xs;
    const float* xsums;
    int64_t groups;
    const uint8_t* panel;
};

template <int R, int V, int C0>
inline void weight_only_tile(const Int4Rows& t, float* y, int64_t ldy, int valid, const float* bias) {
    const auto [xq, ldq, xs, xsums, groups, panel] = t;
    __m256 f[R][V];
    zero_tile(f);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = panel + g * kInt4GroupBytes;
        __m256i a[R][V];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) a[r][v] = _mm256_setzero_si256();
        for (int i = 0; i < kInt4Group / 2; ++i) {
            if (i % 2 == 0)  // 64 bytes on: every line of the stream, codes and scales
                _mm_prefetch(reinterpret_cast<const char*>(group + i * kPanel) + kPrefetch, _MM_HINT_T0);
            __m256i wv[V];
#pragma GCC unroll 2
            for (int v = 0; v < V; v += 2) int4_pairs(group + i * kPanel + C0 + 8 * v, wv[v], wv[v + 1]);
            const int16_t* xi = xq + g * kInt4Group + 2 * i;
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m256i xb = broadcast_pair(xi + r * ldq);
#pragma GCC unroll 4
                for (int v = 0; v < V; ++v) a[r][v] = madd_add(a[r][v], xb, wv[v]);
            }
        }
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(group + kInt4Group * kPanel / 2) + C0;
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
            const __m256 scale = load8(scales + 8 * v), minimum = load8(scales + kPanel + 8 * v);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
                f[r][v] = _mm256_fmadd_ps(minimum, _mm256_broadcast_ss(xsums + r * groups + g),
                                          _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][v]), scale, f[r][v]));
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) f[r][v] = _mm256_mul_ps(f[r][v], _mm256_set1_ps(xs[r]));
    store_columns(f, y, ldy, valid, bias);
}

// x [M, K] (rows ldx apart) @ (codes * scales + minimums)^T (+ bias) -> y [M, N]; K a multiple of kInt4Group.
void linear_int4_weights(const float* x, int64_t ldx, const uint8_t* panels, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, int num_threads) {
    const int64_t groups = K / kInt4Group;
    static thread_local std::vector<int16_t> codes;
    static thread_local std::vector<float> scales;
    codes.resize(size_t(M * K)), scales.resize(size_t(M * (1 + groups)));
    int16_t* q = codes.data();
    float *xs = scales.data(), *xsums = xs + M;
    auto quantize = [&](int64_t m) {
        const int16_t* row = q + m * K;
        quantize_row16(x + m * ldx, K, q + m * K, xs + m);
        for (int64_t g = 0; g < groups; ++g) {
            int32_t sum = 0;
            for (int j = 0; j < kInt4Group; ++j) sum += row[g * kInt4Group + j];
            xsums[m * groups + g] = float(sum);
        }
    };
    quantized_rows_then_panels(M, N, kRows, num_threads, quantize,
                               [&](int64_t p, int64_t m0, int rows, int64_t n0, int valid) {
        weight_only_rows(rows, Int4Rows{q + m0 * K, K, xs + m0, xsums + m0 * groups, groups,
                                        panels + p * groups * kInt4GroupBytes},
                         y + m0 * N + n0, N, valid, bias ? bias + n0 : nullptr);
    });
}
#endif

}  // namespace
