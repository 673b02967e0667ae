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

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ITERSERVE_LINEAR 1
#endif

constexpr int kPanel = 32;           // outputs per panel: two AVX-512 vectors, or four AVX2 ones
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the weight stream

// From how many tiles of rows on a panel of W is widened to float32 once (widen_panel) rather than each
// weight for each tile; 0: never.
template <typename W>
constexpr int kWidenTiles = 0;

// The quantized layers' driver: each row of x quantized (quantize(m), split across the threads), then
// each thread takes a run of panels, tile by tile: tile(p, m0, rows, n0, valid), rows of near-equal
// height, at most max_rows.
template <typename Quantize, typename Tile>
void quantized_rows_then_panels(int64_t M, int64_t N, int max_rows, int num_threads, Quantize quantize, Tile tile) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel, tiles = (M + max_rows - 1) / max_rows;
    auto first_row = [&](int64_t t) { return M * t / tiles; };
#pragma omp parallel num_threads(num_threads) if (num_panels > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quantize(m);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            const int64_t n0 = p * kPanel;
            const int valid = int(std::min<int64_t>(kPanel, N - n0));
            for (int64_t t = 0; t < tiles; ++t) tile(p, first_row(t), int(first_row(t + 1) - first_row(t)), n0, valid);
        }
    }
}

#if defined(__AVX512F__)

constexpr int kRows = 12;  // rows per register tile: 24 accumulators, 2 weight vectors, 1 broadcast

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

// A register tile's sums (+ bias) rounded to T and stored: R rows of the panel's `valid` first columns.
template <int R, typename T>
inline void store_tile(__m512 (&a0)[R], __m512 (&a1)[R], T* y, int64_t ldy, int valid, const T* bias) {
    const __mmask16 lo = valid >= 16 ? 0xffff : __mmask16((1u << valid) - 1);
    const __mmask16 hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : __mmask16((1u << (valid - 16)) - 1);
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

// y[R rows, kPanel] = x[R rows, K] @ panel [K][kPanel] (+ bias), summed in float32 and rounded once to
// T. x is float32, read in place (rows ldx apart) or, Packed, from a tile buffer holding each k's R
// values together. The prefetch runs kPrefetch bytes ahead of the panel (a thread's panels are one
// stream); on a panel's later tiles it finds the lines cached already.
template <int R, bool Packed, typename W, typename T>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, T* y, int64_t ldy, int valid, const T* bias) {
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
    store_tile<R>(a0, a1, y, ldy, valid, bias);
}

#if defined(__AVX512BF16__)
#define ITERSERVE_LINEAR_PAIRS 1

// Native bf16 (x, weights, bias and y all bf16) over panels of k pairs: pairs[p][k / 2][j][2] =
// W[p * kPanel + j][k .. k + 1], so a 64-byte vector holds 16 outputs' pair and one vdpbf16ps adds
// both products to each output's float32 sum: 32 multiply-adds an instruction, twice a float32
// FMA's, with no widening. x's pair at k is one 32-bit broadcast, read in place (rows ldx apart).
// K is even (pack_panels' pairs layout asks for it).
template <int R>
inline void tile_pairs(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy,
                       int valid, const uint16_t* bias) {
    __m512 a0[R], a1[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* wk = w + k * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch + 64, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * ldx + k, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            a0[r] = _mm512_dpbf16_ps(a0[r], xb, w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], xb, w1);
        }
    }
    store_tile<R>(a0, a1, y, ldy, valid, bias);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ITERSERVE_LINEAR_INT8 1

// int8 weights under int8 activations (--quantization w8a8). A panel is quads[Kp / 4][kPanel][4] int8,
// W's symmetric per-output codes (Kp: K rounded up to a group, zero-padded), then kPanel float32 scales,
// then each group's kPanel column sums of the codes (float32). x is quantized as it enters, each row's
// groups of kGroup values asymmetrically over their own range (u8 codes, a scale, a zero point, 0
// exactly representable): one scale a row, as vLLM's w8a8 has it, cost 2.1% in perplexity on the
// default model, groups of 64 0.6%, int8 weights alone 0.5% (docs/performance.md). vpdpbusd adds four
// u8 x s8 products to each of 16 outputs' int32 sums: 64 multiply-adds an instruction, twice
// vdpbf16ps's, over half the weight bytes. Each group's sums go into float32 ones:
// y = w_scale * sum_g s_g * (sum(q_x q_w) - z_g * colsum_g) + bias.
constexpr int kGroup = 64;
constexpr int kRowsInt8 = 6;  // 12 int32 and 12 float32 accumulators, 2 weight vectors, 2 column sums

inline int64_t int8_depth(int64_t K) { return (K + kGroup - 1) / kGroup * kGroup; }
inline int64_t int8_panel_bytes(int64_t Kp) { return Kp * kPanel + kPanel * 4 + Kp / kGroup * kPanel * 4; }

// One row of x -> Kp u8 codes (the padding's codes meet zero weights), and per group its scale and
// scale * zero point.
template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* q, float* scale, float* scaled_zero) {
    constexpr int V = kGroup / 16;
    for (int64_t g0 = 0, g = 0; g0 < int8_depth(K); g0 += kGroup, ++g) {
        const int64_t n = std::min<int64_t>(kGroup, K - g0);
        float mn = 0.0f, mx = 0.0f;
        __m512 v[V];
        if (n == kGroup) {  // a whole group, in registers
            __m512 lo = _mm512_setzero_ps(), hi = lo;
#pragma GCC unroll 4
            for (int i = 0; i < V; ++i) v[i] = load16(x + g0 + 16 * i), lo = _mm512_min_ps(lo, v[i]), hi = _mm512_max_ps(hi, v[i]);
            mn = _mm512_reduce_min_ps(lo), mx = _mm512_reduce_max_ps(hi);
        } else {
            for (int64_t k = 0; k < n; ++k) mn = std::min(mn, to_f32(x[g0 + k])), mx = std::max(mx, to_f32(x[g0 + k]));
        }
        const float s = mx > mn ? (mx - mn) / 255.0f : 1.0f, inv = 1.0f / s;
        const int32_t z = std::clamp(int32_t(std::nearbyint(-mn * inv)), 0, 255);
        if (n == kGroup) {
            const __m512 vinv = _mm512_set1_ps(inv);
            const __m512i vz = _mm512_set1_epi32(z), v0 = _mm512_setzero_si512(), v255 = _mm512_set1_epi32(255);
#pragma GCC unroll 4
            for (int i = 0; i < V; ++i) {  // cvtps rounds to nearest even, as nearbyint does
                __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], vinv)), vz);
                c = _mm512_min_epi32(_mm512_max_epi32(c, v0), v255);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g0 + 16 * i), _mm512_cvtepi32_epi8(c));
            }
        } else {
            for (int64_t k = 0; k < n; ++k)
                q[g0 + k] = uint8_t(std::clamp(int32_t(std::nearbyint(to_f32(x[g0 + k]) * inv)) + z, 0, 255));
            for (int64_t k = n; k < kGroup; ++k) q[g0 + k] = 0;
        }
        scale[g] = s, scaled_zero[g] = s * float(z);
    }
}

// acc + the dot products of a's u8 and b's s8 quads, as _mm512_dpbusd_epi32, in asm: GCC 12 copies the
// intrinsic's accumulators from register to register around every one (two moves a vpdpbusd); tied to
// an asm operand each stays in its register (1-7% faster, docs/performance.md).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

template <int R, typename T>
inline void tile_int8(const uint8_t* xq, int64_t ldq, const float* xs, const float* xsz, int64_t lds, const int8_t* w,
                      int64_t Kp, T* y, int64_t ldy, int valid, const T* bias) {
    const float* wscale = reinterpret_cast<const float*>(w + Kp * kPanel);
    const float* colsum = wscale + kPanel;
    __m512 f0[R], f1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < Kp; g0 += kGroup, ++g) {
        __m512i a0[R], a1[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int64_t k = g0; k < g0 + kGroup; k += 4) {
            const int8_t* wk = w + k * kPanel;
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch + 64, _MM_HINT_T0);
            const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                std::memcpy(&quad, xq + r * ldq + k, 4);
                const __m512i xb = _mm512_set1_epi32(quad);
                a0[r] = dpbusd(a0[r], xb, w0);
                a1[r] = dpbusd(a1[r], xb, w1);
            }
        }
        const __m512 c0 = _mm512_loadu_ps(colsum + g * kPanel), c1 = _mm512_loadu_ps(colsum + g * kPanel + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512 s = _mm512_set1_ps(xs[r * lds + g]), sz = _mm512_set1_ps(xsz[r * lds + g]);
            f0[r] = _mm512_fnmadd_ps(c0, sz, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), s, f0[r]));
            f1[r] = _mm512_fnmadd_ps(c1, sz, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), s, f1[r]));
        }
    }
    const __m512 s0 = _mm512_loadu_ps(wscale), s1 = _mm512_loadu_ps(wscale + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f0[r] = _mm512_mul_ps(f0[r], s0), f1[r] = _mm512_mul_ps(f1[r], s1);
    store_tile<R>(f0, f1, y, ldy, valid, bias);
}

template <typename T, int R = 1>
void tile_rows_int8(int rows, const uint8_t* xq, int64_t ldq, const float* xs, const float* xsz, int64_t lds,
                    const int8_t* w, int64_t Kp, T* y, int64_t ldy, int valid, const T* bias) {
    if (rows == R)
        tile_int8<R>(xq, ldq, xs, xsz, lds, w, Kp, y, ldy, valid, bias);
    else if constexpr (R < kRowsInt8)
        tile_rows_int8<T, R + 1>(rows, xq, ldq, xs, xsz, lds, w, Kp, y, ldy, valid, bias);
}

// x [M, K] (rows ldx apart, float32 or bf16, as bias and y) @ W^T over the int8 panels above: the rows
// quantized first (split across the threads), then each thread takes a run of panels, tile by tile.
template <typename T>
void linear_int8(const T* x, int64_t ldx, const int8_t* panels, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
                 int num_threads) {
    const int64_t Kp = int8_depth(K), groups = Kp / kGroup, stride = int8_panel_bytes(Kp);
    static thread_local std::vector<uint8_t> codes;
    static thread_local std::vector<float> scales;
    codes.resize(size_t(M * Kp)), scales.resize(size_t(2 * M * groups));
    uint8_t* q = codes.data();
    float *xs = scales.data(), *xsz = xs + M * groups;
    quantized_rows_then_panels(
        M, N, kRowsInt8, num_threads,
        [&](int64_t m) { quantize_row(x + m * ldx, K, q + m * Kp, xs + m * groups, xsz + m * groups); },
        [&](int64_t p, int64_t m0, int rows, int64_t n0, int valid) {
            tile_rows_int8(rows, q + m0 * Kp, Kp, xs + m0 * groups, xsz + m0 * groups, groups, panels + p * stride, Kp,
                           y + m0 * N + n0, N, valid, bias ? bias + n0 : nullptr);
        });
}
#endif

#elif defined(ITERSERVE_LINEAR)  // AVX2 + FMA

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

#if defined(ITERSERVE_LINEAR_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ITERSERVE_LINEAR_AMX 1

// AMX: the pairs panels are already the layout a bf16 tile multiply takes as its second operand (16
// pairs of k by 16 columns, 64 bytes a row): a panel's k pairs are 128-byte rows, so its two halves
// load as two tiles 128 bytes apart, and x's rows load in place as the first operand. One
// tdpbf16ps does 16 x 16 x 32 multiply-adds; a block of 32 rows by one panel keeps four float32
// accumulator tiles (tmm0-3) against two tiles of x (tmm4-5) and the panel's two halves (tmm6-7).
// Every row count takes the tiles, one row too: a row's sums then do not depend on how many rows
// share the call (a speculative verify step's rows equal the decode steps' bits; vdpbf16ps sums in
// another order). At one row it costs nothing over a weight stream from memory and ~17% over
// in-cache weights; from 8 rows on it is 2-7x the vdpbf16ps tiles (docs/performance.md).
constexpr int64_t kAmxRows = 1;
// x goes over the panels in chunks of rows of about this many bytes, which stay in L2 while a thread's
// panels stream past; the panels are re-read once a chunk (from L3 at these sizes).
#ifndef ITERSERVE_AMX_CHUNK
#define ITERSERVE_AMX_CHUNK (1 << 20)
#endif
constexpr int64_t kAmxChunkBytes = ITERSERVE_AMX_CHUNK;

// Linux grants the tile state to a process on request (ARCH_REQ_XCOMP_PERM); then every thread has it.
bool amx_permitted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

void configure_tiles() {  // per thread: the tile configuration is thread state
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

// c[Rows][kPanel] float32 = x[Rows (16 or 32) rows, ldx apart][K] @ panel; K a multiple of 32.
template <int Rows>
void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, float* c) {
    const int64_t x_stride = ldx * 2;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Rows == 32) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* w = panel + k * kPanel;
        _tile_loadd(6, w, 128);
        _tile_loadd(7, w + 32, 128);
        _tile_loadd(4, x + k, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (Rows == 32) {
            _tile_loadd(5, x + 16 * ldx + k, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, kPanel * 4);
    _tile_stored(1, c + 16, kPanel * 4);
    if constexpr (Rows == 32) {
        _tile_stored(2, c + 16 * kPanel, kPanel * 4);
        _tile_stored(3, c + 16 * kPanel + 16, kPanel * 4);
    }
}

// c's first `rows` rows (+ bias) rounded to bfloat16 into y's rows, the panel's `valid` first columns.
void store_block(const float* c, int rows, uint16_t* y, int64_t ldy, int valid, const uint16_t* bias) {
    const __mmask16 lo = valid >= 16 ? 0xffff : __mmask16((1u << valid) - 1);
    const __mmask16 hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : __mmask16((1u << (valid - 16)) - 1);
    const __m512 b0 = bias ? load_masked(bias, lo) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_masked(bias + 16, hi) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        store_masked(y + r * ldy, lo, _mm512_add_ps(_mm512_loadu_ps(c + r * kPanel), b0));
        store_masked(y + r * ldy + 16, hi, _mm512_add_ps(_mm512_loadu_ps(c + r * kPanel + 16), b1));
    }
}

// The pairs layout's linear on AMX tiles (K a multiple of 32): each thread takes a run of panels, as
// linear() does, and goes over x in blocks of 32 rows, then 16; a last partial block of 16 is copied
// once, zero-padded, so every tile load is a whole tile.
void linear_amx(const uint16_t* x, int64_t ldx, const uint16_t* panels, const uint16_t* bias, uint16_t* y, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel, whole = M / 16 * 16, tail = M - whole;
    static thread_local std::vector<uint16_t> padded;
    if (tail) {
        padded.assign(size_t(16 * K), 0);
        for (int64_t r = 0; r < tail; ++r) std::memcpy(&padded[size_t(r * K)], x + (whole + r) * ldx, size_t(K) * 2);
    }
    const uint16_t* tail_x = padded.data();
#pragma omp parallel num_threads(num_threads) if (num_panels > 1)
    {
        configure_tiles();
        alignas(64) float c[32 * kPanel];
        const int64_t chunk = std::max<int64_t>(32, kAmxChunkBytes / (2 * K) / 32 * 32);
        for (int64_t c0 = 0; c0 == 0 || c0 < whole; c0 += chunk) {
            const int64_t c1 = std::min(whole, c0 + chunk);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; ++p) {
                const int64_t n0 = p * kPanel;
                const int valid = int(std::min<int64_t>(kPanel, N - n0));
                const uint16_t* w = panels + p * K * kPanel;
                const uint16_t* b = bias ? bias + n0 : nullptr;
                int64_t m0 = c0;
                for (; m0 + 32 <= c1; m0 += 32) {
                    amx_block<32>(x + m0 * ldx, ldx, w, K, c);
                    store_block(c, 32, y + m0 * N + n0, N, valid, b);
                }
                if (m0 < c1) {
                    amx_block<16>(x + m0 * ldx, ldx, w, K, c);
                    store_block(c, 16, y + m0 * N + n0, N, valid, b);
                }
                if (tail && c1 == whole) {
                    amx_block<16>(tail_x, K, w, K, c);
                    store_block(c, int(tail), y + whole * N + n0, N, valid, b);
                }
            }
        }
        _tile_release();
    }
}
#endif

#if !defined(__AVX512F__)
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
constexpr int kInt4Group = 32;
constexpr int64_t kInt4GroupBytes = kInt4Group * kPanel / 2 + 2 * kPanel * 2;

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
// multiple of 32).
// x rows ldx elements apart, y contiguous; bias may be null. Returns 0, or -1 where this build cannot
// run it.
int iterserve_linear(int dtype, const void* x, int64_t ldx, const void* panels, const void* bias, void* y,
                     int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(ITERSERVE_LINEAR)
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
