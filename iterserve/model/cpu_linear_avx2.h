// The linear layer's AVX2 register tiles, where there is no AVX-512.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_linear.h"

namespace {

#if defined(ITERSERVE_LINEAR) && !defined(__AVX512F__)  // AVX2 + FMA
constexpr int kRows = 6;  // rows per register tile (see tile below)
template <>  // bf16 (M > 42), where it was measured to pay; on AVX-512 not measured: a k's widening serves 24 FMAs
constexpr int kWidenTiles<uint16_t> = 8;

template <int R, int V>
inline void zero_tile(__m256 (&a)[R][V]) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) a[r][v] = _mm256_setzero_ps();
}

// A tile's sums (+ bias) rounded to T and stored: R rows of its 8V columns' `valid` first.
template <int R, int V, typename T>
inline void store_columns(__m256 (&a)[R][V], T* y, int64_t ldy, int valid, const T* bias) {
    float b[8 * V] = {};
    if (bias)
        for (int j = 0; j < valid; ++j) b[j] = to_f32(bias[j]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
        T* yr = y + r * ldy;
        if (valid == 8 * V) {
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v)
                store8(yr + 8 * v, bias ? _mm256_add_ps(a[r][v], _mm256_loadu_ps(b + 8 * v)) : a[r][v]);
        } else {
            float row[8 * V];
            for (int v = 0; v < V; ++v)
                _mm256_storeu_ps(row + 8 * v, _mm256_add_ps(a[r][v], _mm256_loadu_ps(b + 8 * v)));
            for (int j = 0; j < valid; ++j) from_f32(row[j], yr + j);
        }
    }
}

// As the AVX-512 tile, over 8-lane vectors: V of them, the columns c0 .. c0 + 8V of the panel (w, y and
// bias start at c0; `valid` counts from there). Columns past the matrix's N are summed too (the
// padding is zeros) and only the valid ones stored.
template <int R, int V, bool Packed, typename W, typename T>
inline void tile_columns(const float* x, int64_t ldx, const W* w, int64_t K, T* y, int64_t ldy, int valid,
                         const T* bias) {
    __m256 a[R][V];
    zero_tile(a);
    for (int64_t k = 0; k < K; ++k) {
        const W* wk = w + k * kPanel;
        for (size_t b = 0; b < 8 * V * sizeof(W); b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch + b, _MM_HINT_T0);
        __m256 wv[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) wv[v] = load8(wk + 8 * v);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(Packed ? x + k * R + r : x + r * ldx + k);
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) a[r][v] = _mm256_fmadd_ps(xb, wv[v], a[r][v]);
        }
    }
    store_columns(a, y, ldy, valid, bias);
}

// Up to 3 rows take the panel's 32 columns in one pass (12 accumulators, 4 weight vectors): a small
// batch streams each panel once. 4-6 rows take it in two passes of 16 columns, the classic 6 x 16
// AVX2 register tile: 2 weight loads and 6 broadcasts per 12 FMAs, where 3 x 32 needs 12 loads
// (the compiler folds each weight load into its FMA rather than hold it in the 16th register).
template <int R, bool Packed, typename W, typename T>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, T* y, int64_t ldy, int valid, const T* bias) {
    if constexpr (R <= 3) {
        tile_columns<R, 4, Packed>(x, ldx, w, K, y, ldy, valid, bias);
    } else {
        tile_columns<R, 2, Packed>(x, ldx, w, K, y, ldy, std::min(valid, 16), bias);
        if (valid > 16)
            tile_columns<R, 2, Packed>(x, ldx, w + 16, K, y + 16, ldy, valid - 16, bias ? bias + 16 : nullptr);
    }
}

#endif

}  // namespace
