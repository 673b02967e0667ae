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
// AVX-512 only: iterserve_linear_supported() says whether this build has it; otherwise quant.py keeps
// oneDNN's packed weights.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

#if defined(__AVX512F__)

constexpr int kPanel = 32;           // outputs per panel: two AVX-512 vectors
constexpr int kRows = 12;            // rows per register tile: 24 accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the weight stream

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(const uint16_t* p) { return load16(p); }
inline __m512 load_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_masked(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_masked(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_masked(uint16_t* p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// y[R rows, kPanel] = x[R rows, K] @ panel [K][kPanel] (+ bias), summed in float32 and rounded once to
// T. x is float32, read in place (rows ldx apart) or, Packed, from a tile buffer holding each k's R
// values together. The prefetch runs kPrefetch bytes ahead of the panel (a thread's panels are one
// stream); on a panel's later tiles it finds the lines cached already.
template <int R, bool Packed, typename W, typename T>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, T* y, int64_t ldy, __mmask16 lo, __mmask16 hi,
                 const T* bias) {
    __m512 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const W* wk = w + k * kPanel;
        for (size_t b = 0; b < kPanel * sizeof(W); b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch + b, _MM_HINT_T0);
        const __m512 w0 = widen(wk), w1 = widen(wk + 16);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512 xb = _mm512_set1_ps(Packed ? x[k * R + r] : x[r * ldx + k]);
            a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
        }
    }
    if (bias) {
        const __m512 b0 = load_masked(bias, lo), b1 = load_masked(bias + 16, hi);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) a0[r] = _mm512_add_ps(a0[r], b0), a1[r] = _mm512_add_ps(a1[r], b1);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
        store_masked(y + r * ldy, lo, a0[r]);
        store_masked(y + r * ldy + 16, hi, a1[r]);
    }
}

template <bool Packed, typename W, typename T>
void tile_rows(int rows, const float* x, int64_t ldx, const W* w, int64_t K, T* y, int64_t ldy, __mmask16 lo,
               __mmask16 hi, const T* bias) {
    switch (rows) {
#define ROWS(R) case R: tile<R, Packed>(x, ldx, w, K, y, ldy, lo, hi, bias); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
    }
    static_assert(kRows == 12, "one case per tile height");
}

// x [M, K] (rows ldx apart) @ W^T (+ bias) -> y [M, N] contiguous, all of type T; W's panels as above.
// Each thread takes a run of panels and computes every tile of rows against each. One float32 tile
// (M <= kRows) reads x in place; otherwise x is packed first, tile by tile (rows of near-equal
// height: 13 are 6 + 7), each tile's rows interleaved k by k and widened to float32, so a tile is
// one short stream rather than kRows rows whose strides can alias in L1.
template <typename W, typename T>
void linear(const T* x, int64_t ldx, const W* panels, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
            int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    const int64_t tiles = (M + kRows - 1) / kRows;
    constexpr bool in_place = std::is_same_v<T, float>;
    const bool packed = tiles > 1 || !in_place;
    static thread_local std::vector<float> buffer;  // at most max_num_batched_tokens x K floats, kept for reuse
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
            const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, N - n0);
            const __mmask16 lo = valid >= 16 ? 0xffff : __mmask16((1u << valid) - 1);
            const __mmask16 hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : __mmask16((1u << (valid - 16)) - 1);
            const W* w = panels + p * K * kPanel;
            const T* b = bias ? bias + n0 : nullptr;
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t m0 = first_row(t), rows = first_row(t + 1) - m0;
                if constexpr (in_place) {
                    if (!packed) {
                        tile_rows<false>(int(rows), reinterpret_cast<const float*>(x), ldx, w, K, y + n0, N, lo, hi, b);
                        continue;
                    }
                }
                tile_rows<true>(int(rows), xp + m0 * K, 0, w, K, y + m0 * N + n0, N, lo, hi, b);
            }
        }
    }
}

#endif

}  // namespace

extern "C" {

int iterserve_linear_supported() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// dtype of x, the panels, bias and y: 0 float32, 1 bfloat16; 2 bfloat16 panels, the rest float32.
// x rows ldx elements apart, y contiguous; bias may be null. Returns 0, or -1 where this build cannot
// run it.
int iterserve_linear(int dtype, const void* x, int64_t ldx, const void* panels, const void* bias, void* y,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(__AVX512F__)
    if (dtype == 0)
        linear(static_cast<const float*>(x), ldx, static_cast<const float*>(panels), static_cast<const float*>(bias),
               static_cast<float*>(y), M, N, K, num_threads);
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
