// The CPU linear layer (see cpu_kernels.py): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W packed as
// panels of kPanel outputs, panels[p][k][j] = W[p * kPanel + j][k] (zero rows pad N up to a panel).
//
// A decode step at a small batch reads every weight once and does 2 M flops per weight read: it runs
// at memory speed, and oneDNN's GEMV reaches only part of that. Here each thread takes a contiguous
// run of panels, which is one forward stream in memory, and prefetches it kPrefetch bytes ahead, so
// the loads that feed the FMAs hit L1. Each weight vector loaded feeds up to kRows rows of x held in
// a register tile; a larger batch goes tile by tile over each panel while it sits in L2, so the same
// layout serves the compute-bound large batches too.
//
// float32, or bfloat16 throughout (x, weights, bias, y), or bfloat16 weights under float32 x, bias
// and y (--dtype bf16-storage): bf16 values are widened in registers (a 16-bit shift), summed in
// float32 and rounded once at the end, as torch's bf16 matmul does. On a CPU without AVX-512 BF16
// that halves the bytes a step reads, at float32's arithmetic cost.
//
// AVX-512, or AVX2 with FMA (kPanel is then four 8-lane vectors, and a register tile at most 6 rows by
// 16 columns, what its 16 registers hold): iterserve_linear_supported() says whether this build has
// either; otherwise quant.py keeps oneDNN's packed weights.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_linear.h"
#include "cpu_linear_avx512.h"
#include "cpu_linear_avx2.h"
#include "cpu_linear_amx.h"
#include "cpu_linear_weight_only.h"
#include "cpu_linear_weight_only_amx.h"

namespace {

#if defined(ITERSERVE_LINEAR)

// A bf16 panel widened to float32 once, in this thread's buffer (K x kPanel floats, 72-196 KB for the
// model's weights: it stays in L2 while the tiles of a large batch run over it), where otherwise each
// of them would widen every weight again: on AVX2 that is two vector ops per 8 weights beside 12 FMAs.
[[maybe_unused]] const float* widen_panel(const uint16_t* w, int64_t K) {
    static thread_local std::vector<float> wide;
    wide.resize(size_t(K * kPanel));
    float* out = wide.data();
    for (int64_t i = 0; i < K * kPanel; ++i) out[i] = to_f32(w[i]);
    return out;
}

#if !defined(ITERSERVE_LINEAR_PAIRS)
template <int R>  // declared only: a build without AVX-512 BF16 declines the pairs layout
void tile_pairs(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy, int valid,
                const uint16_t* bias);
#endif

// A tile of 1 .. kRows rows: R, the register tile's height, is a compile-time constant.
template <bool Packed, bool Pairs, int R = 1, typename X, typename P, typename T>
void tile_rows(int rows, const X* x, int64_t ldx, P w, int64_t K, T* y, int64_t ldy, int valid, const T* bias) {
    if (rows == R) {
        if constexpr (Pairs)
            tile_pairs<R>(x, ldx, w, K, y, ldy, valid, bias);
        else
            tile<R, Packed>(x, ldx, w, K, y, ldy, valid, bias);
    } else if constexpr (R < kRows) {
        tile_rows<Packed, Pairs, R + 1>(rows, x, ldx, w, K, y, ldy, valid, bias);
    }
}

// x [M, K] (rows ldx apart) @ W^T (+ bias) -> y [M, N] contiguous, all of type T; W's panels as above
// (Pairs: the pairs layout, all bf16). Each thread takes a run of panels and computes every tile of rows
// against each. Pairs' bf16 and one tile (M <= kRows) of float32 read x in place; otherwise x is
// packed first, tile by tile (rows of near-equal height: 13 are 6 + 7), each tile's rows widened to
// float32 and interleaved k by k, so a tile is one short stream. Packing bf16 for the pairs tiles (a
// scalar transpose) was 6% of a 512-token prefill and bought nothing: without it, 7-9% less time at
// 64 and 512 rows (measured on Zen 4, docs/performance.md).
template <typename W, typename T, bool Pairs = false>
void linear(const T* x, int64_t ldx, const W* panels, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
            int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    const int64_t tiles = (M + kRows - 1) / kRows;
    const bool packed = !Pairs && (tiles > 1 || !std::is_same_v<T, float>);
    static thread_local std::vector<float> buffer;  // at most max_num_batched_tokens x K values, kept for reuse
    if (packed) buffer.resize(size_t(M * K));
    float* xp = buffer.data();
    auto first_row = [&](int64_t t) { return M * t / tiles; };
#pragma omp parallel num_threads(num_threads) if (num_panels > 1)
    {
        if (packed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t m0 = first_row(t), rows = first_row(t + 1) - m0;
                for (int64_t k = 0; k < K; ++k)
                    for (int64_t r = 0; r < rows; ++r) xp[m0 * K + k * rows + r] = to_f32(x[(m0 + r) * ldx + k]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            const int64_t n0 = p * kPanel;
            const int valid = int(std::min<int64_t>(kPanel, N - n0));
            const W* w = panels + p * K * kPanel;
            const T* b = bias ? bias + n0 : nullptr;
            if constexpr (kWidenTiles<W> > 0 && !Pairs) {
                if (tiles >= kWidenTiles<W>) {
                    const float* wide = widen_panel(w, K);
                    for (int64_t t = 0; t < tiles; ++t) {
                        const int64_t m0 = first_row(t), rows = first_row(t + 1) - m0;
                        tile_rows<true, false>(int(rows), xp + m0 * K, 0, wide, K, y + m0 * N + n0, N, valid, b);
                    }
                    continue;
                }
            }
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t m0 = first_row(t), rows = first_row(t + 1) - m0;
                if constexpr (!Pairs) {
                    if (packed) {
                        tile_rows<true, false>(int(rows), xp + m0 * K, 0, w, K, y + m0 * N + n0, N, valid, b);
                        continue;
                    }
                }
                if constexpr (Pairs || std::is_same_v<T, float>)
                    tile_rows<false, Pairs>(int(rows), x + m0 * ldx, ldx, w, K, y + m0 * N + n0, N, valid, b);
            }
        }
    }
}

#endif

}  // namespace

extern "C" {

int iterserve_linear_supported() {
#if defined(ITERSERVE_LINEAR)
    return 1;
#else
    return 0;
#endif
}

// Whether this build takes dtype 3, the pairs layout (AVX-512 BF16).
int iterserve_linear_pairs_supported() {
#if defined(ITERSERVE_LINEAR_PAIRS)
    return 1;
#else
    return 0;
#endif
}

// Whether this build runs the pairs layout on AMX tiles, and the OS grants them.
int iterserve_linear_amx_supported() {
#if defined(ITERSERVE_LINEAR_AMX)
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// Whether this build takes dtypes 6 and 7, weight-only int8 and int4 panels (AVX2 without AVX-512).
int iterserve_linear_weight_only_supported() {
#if defined(ITERSERVE_LINEAR_WEIGHT_ONLY)
    return 1;
#else
    return 0;
#endif
}

// Whether this build takes dtypes 8 and 9, weight-only int8 and int4 panels under bfloat16 (AVX-512 BF16: on AMX
// tiles where there are some and the OS grants them, else on vdpbf16ps).
int iterserve_linear_weight_only_bf16_supported() {
#if defined(ITERSERVE_LINEAR_WEIGHT_ONLY_BF16)
    return 1;
#else
    return 0;
#endif
}

// Whether this build takes dtypes 4 and 5, the int8 panels (AVX-512 VNNI).
int iterserve_linear_int8_supported() {
#if defined(ITERSERVE_LINEAR_INT8)
    return 1;
#else
    return 0;
#endif
}

// dtype of x, the panels, bias and y: 0 float32, 1 bfloat16; 2 bfloat16 panels, the rest float32;
// 3 bfloat16 throughout, the panels in the pairs layout; 4 / 5 int8 panels (w8a8) under float32 /
// bfloat16 x, bias and y; 6 / 7 weight-only int8 / int4 panels under float32 x, bias and y (int4: K a
// multiple of 32); 8 / 9 the same panels under bfloat16 x, bias and y (AVX-512 BF16, AMX; K a multiple of 32).
// x rows ldx elements apart, y contiguous; bias may be null. Returns 0, or -1 where this build cannot
// run it.
int iterserve_linear(int dtype, const void* x, int64_t ldx, const void* panels, const void* bias, void* y,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(ITERSERVE_LINEAR)
    if (dtype == 8 || dtype == 9) {
#if defined(ITERSERVE_LINEAR_WEIGHT_ONLY_BF16)
        if (K % 32) return -1;
        const auto* xb = static_cast<const uint16_t*>(x);
        const auto* b = static_cast<const uint16_t*>(bias);
        auto* yb = static_cast<uint16_t*>(y);
        const auto* codes = static_cast<const int8_t*>(panels);
        const Int4Panels int4{static_cast<const uint8_t*>(panels), K};
        const float* scale = dtype == 8 ? reinterpret_cast<const float*>(codes + (N + kPanel - 1) / kPanel * kPanel * K)
                                        : nullptr;
#if defined(ITERSERVE_LINEAR_AMX)
        if (amx_permitted()) {
            if (dtype == 8)
                linear_weight_only_bf16(xb, ldx, Int8Panels{codes, K}, scale, b, yb, M, N, K, num_threads);
            else
                linear_weight_only_bf16(xb, ldx, int4, nullptr, b, yb, M, N, K, num_threads);
            return 0;
        }
#endif
        if (dtype == 8)
            linear_weight_only_pairs(xb, ldx, Int8Panels{codes, K, scale}, b, yb, M, N, K, num_threads);
        else
            linear_weight_only_pairs(xb, ldx, int4, b, yb, M, N, K, num_threads);
        return 0;
#else
        return -1;
#endif
    }
    if (dtype == 6 || dtype == 7) {
#if defined(ITERSERVE_LINEAR_WEIGHT_ONLY)
        if (dtype == 7 && K % kInt4Group) return -1;
        if (dtype == 6)
            linear_int8_weights(static_cast<const float*>(x), ldx, static_cast<const int8_t*>(panels),
                                static_cast<const float*>(bias), static_cast<float*>(y), M, N, K, num_threads);
        else
            linear_int4_weights(static_cast<const float*>(x), ldx, static_cast<const uint8_t*>(panels),
                                static_cast<const float*>(bias), static_cast<float*>(y), M, N, K, num_threads);
        return 0;
#else
        return -1;
#endif
    }
    if (dtype == 4 || dtype == 5) {
#if defined(ITERSERVE_LINEAR_INT8)
        if (dtype == 4)
            linear_int8(static_cast<const float*>(x), ldx, static_cast<const int8_t*>(panels),
                        static_cast<const float*>(bias), static_cast<float*>(y), M, N, K, num_threads);
        else
            linear_int8(static_cast<const uint16_t*>(x), ldx, static_cast<const int8_t*>(panels),
                        static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, K, num_threads);
        return 0;
#else
        return -1;
#endif
    }
    if (dtype == 0)
        linear(static_cast<const float*>(x), ldx, static_cast<const float*>(panels), static_cast<const float*>(bias),
               static_cast<float*>(y), M, N, K, num_threads);
    else if (dtype == 3)
#if defined(ITERSERVE_LINEAR_PAIRS)
#if defined(ITERSERVE_LINEAR_AMX)
        if (M >= kAmxRows && K % 32 == 0 && amx_permitted())
            linear_amx(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(panels),
                       static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, K, num_threads);
        else
#endif
        linear<uint16_t, uint16_t, true>(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(panels),
                                         static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, K,
                                         num_threads);
#else
        return -1;
#endif
    else if (dtype == 2)
        linear(static_cast<const float*>(x), ldx, static_cast<const uint16_t*>(panels), static_cast<const float*>(bias),
               static_cast<float*>(y), M, N, K, num_threads);
    else
        linear(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(panels),
               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, K, num_threads);
    return 0;
#else
    (void)dtype, (void)x, (void)ldx, (void)panels, (void)bias, (void)y, (void)M, (void)N, (void)K,
        (void)num_threads;
    return -1;
#endif
}

}
