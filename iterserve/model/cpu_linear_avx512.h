// The linear layer's AVX-512 register tiles: float32 and bf16 (tile), bf16 pairs (tile_pairs), int8 w8a8
// (tile_int8, linear_int8).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_linear.h"

namespace {

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
#endif

}  // namespace
