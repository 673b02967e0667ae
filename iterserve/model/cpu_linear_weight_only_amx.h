// Weight-only int8 and int4 linear layers on AMX tiles (linear_weight_only_amx), or on vdpbf16ps without them
// (linear_weight_only_pairs: Zen 4): bfloat16 x, bias and y over the panels cpu_linear_weight_only.h describes
// (the AVX2 kernels' own: one layout, one packer, one cache entry).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_linear_amx.h"

namespace {

#if defined(ITERSERVE_LINEAR_PAIRS) && defined(__AVX512BW__)
#define ITERSERVE_LINEAR_WEIGHT_ONLY_BF16 1

// A panel's codes are turned into bfloat16 in the pairs layout (what amx_block reads: a k pair a 128-byte
// row) in a buffer of the thread's, and the tiles run over that: the codes are read once a call, and their
// unpacking (8-9 vector ops per 32 weights) is paid once a panel, however many rows share it. Up to 32 rows
// (decode) a panel goes kDequantDepth inputs at a time (a buffer in L1, the tiles' sums kept in their
// registers in between); more rows take the whole panel (K x 64 bytes, in L2) and go over it block by
// block. Either way each tile adds its k steps in the same order, so a row's bits do not depend on the batch.
#ifndef ITERSERVE_DEQUANT_DEPTH
#define ITERSERVE_DEQUANT_DEPTH 128
#endif
constexpr int64_t kDequantDepth = ITERSERVE_DEQUANT_DEPTH;
// The codes are read in bursts, a depth at a time between the tiles' work: prefetched further ahead than the
// float kernels' kPrefetch, so that the next burst's lines are on their way meanwhile.
#ifndef ITERSERVE_WEIGHT_PREFETCH
#define ITERSERVE_WEIGHT_PREFETCH 4096
#endif
constexpr int64_t kWeightPrefetch = ITERSERVE_WEIGHT_PREFETCH;

// int8: the codes are already in pairs, [K / 2][kPanel][2]; 16 bytes widen to 16 float32 lanes, which
// vcvtne2ps2bf16 rounds exactly (|q| <= 127) and lays side by side, so 32 bytes give 64 bytes of the row in
// place. On the tiles the row scales stay out of the weights: y = scale * (x . q), at the store; the
// vdpbf16ps tiles store their sums as they are, so there (`scale` given) the weights are q * scale, rounded.
struct Int8Panels {
    const int8_t* codes;
    int64_t K;
    const float* scale = nullptr;
    void operator()(int64_t p, int64_t k0, int64_t k1, uint16_t* out) const {
        const int8_t* src = codes + p * K * kPanel + k0 * kPanel;
        __m512 twice[4];  // columns 0-7, 8-15, 16-23, 24-31's scales, each for both inputs of a pair
        const __m512i pair_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        for (int j = 0; j < 4 && scale; ++j) {
            const __m256 eight = _mm256_loadu_ps(scale + p * kPanel + 8 * j);
            twice[j] = _mm512_permutexvar_ps(pair_lanes, _mm512_castps256_ps512(eight));
        }
        for (int64_t i = 0; i < (k1 - k0) * kPanel; i += 32) {
            if (i % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + i) + kWeightPrefetch, _MM_HINT_T0);
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + i))));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + i + 16))));
            if (scale) {
                const int h = int(i % 64) / 32;
                a = _mm512_mul_ps(a, twice[2 * h]), b = _mm512_mul_ps(b, twice[2 * h + 1]);
            }
            _mm512_store_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
};

// int4: per group, per k pair, byte j holds column j's code at the even k (low nibble) and at the odd k (high
// one). A pair's 16 bytes for 16 columns, broadcast to the four 128-bit lanes, are shuffled to bits 8-15 of 16
// float32 lanes; or-ing in 1.0's exponent makes each nibble a float with no conversion: 1 + q / 2^15 (even k,
// bits 8-11) and 1 + q / 2^11 (odd k, bits 12-15). One FMA each then gives q * scale + minimum, as
// (1 + q / 2^15) * 2^15 scale + (minimum - 2^15 scale): the product is exact, so where minimum - 2^15 scale is
// too (bf16 scale and minimum, their exponents within 16 of each other) the FMA rounds once, as q * scale +
// minimum does; otherwise it is off by at most scale / 2^9. The two halves, rounded to bfloat16 side by side,
// are interleaved into (even, odd) pairs by one vpermw.
struct Int4Panels {
    const uint8_t* groups;
    int64_t K;
    void operator()(int64_t p, int64_t k0, int64_t k1, uint16_t* out) const {
        alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        alignas(64) static const uint8_t spread[64] = {  // 128-bit lane l: bytes 4l .. 4l + 3 to bits 8-15
            128, 0,  128, 128, 128, 1,  128, 128, 128, 2,  128, 128, 128, 3,  128, 128,
            128, 4,  128, 128, 128, 5,  128, 128, 128, 6,  128, 128, 128, 7,  128, 128,
            128, 8,  128, 128, 128, 9,  128, 128, 128, 10, 128, 128, 128, 11, 128, 128,
            128, 12, 128, 128, 128, 13, 128, 128, 128, 14, 128, 128, 128, 15, 128, 128};
        const __m512i order = _mm512_load_si512(interleave), shuffle = _mm512_load_si512(spread);
        const __m512i one = _mm512_set1_epi32(0x3f800000), even_bits = _mm512_set1_epi32(0x00000f00),
                      odd_bits = _mm512_set1_epi32(0x0000f000);
        const uint8_t* panel = groups + p * (K / kInt4Group) * kInt4GroupBytes;
        for (int64_t g = k0 / kInt4Group; g < k1 / kInt4Group; ++g, out += kInt4Group * kPanel) {
            const uint8_t* group = panel + g * kInt4GroupBytes;
            const uint16_t* scales = reinterpret_cast<const uint16_t*>(group + kInt4Group * kPanel / 2);
            __m512 se[2], me[2], so[2], mo[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                const __m512 s = load16(scales + 16 * h), m = load16(scales + kPanel + 16 * h);
                se[h] = _mm512_mul_ps(s, _mm512_set1_ps(32768.0f)), me[h] = _mm512_sub_ps(m, se[h]);
                so[h] = _mm512_mul_ps(s, _mm512_set1_ps(2048.0f)), mo[h] = _mm512_sub_ps(m, so[h]);
            }
#pragma GCC unroll 4
            for (int i = 0; i < kInt4Group / 2; ++i) {
                if (i < int(kInt4GroupBytes / 64))  // the stream's every line, kWeightPrefetch bytes ahead
                    _mm_prefetch(reinterpret_cast<const char*>(group) + 64 * i + kWeightPrefetch, _MM_HINT_T0);
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    const __m512i b = _mm512_shuffle_epi8(
                        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(group + i * kPanel + 16 * h))), shuffle);
                    const __m512 even = _mm512_fmadd_ps(
                        _mm512_castsi512_ps(_mm512_ternarylogic_epi32(b, even_bits, one, 0xea)), se[h], me[h]);
                    const __m512 odd = _mm512_fmadd_ps(
                        _mm512_castsi512_ps(_mm512_ternarylogic_epi32(b, odd_bits, one, 0xea)), so[h], mo[h]);
                    const __m512i pairs = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
                    _mm512_store_si512(out + i * 2 * kPanel + 32 * h, pairs);
                }
            }
        }
    }
};

// A buffer of the calling thread's, 64-byte aligned, of at least n values (kept for the next call).
inline uint16_t* thread_buffer(size_t n) {
    struct Free {
        void operator()(uint16_t* p) const { std::free(p); }
    };
    static thread_local std::unique_ptr<uint16_t, Free> buffer;
    static thread_local size_t size = 0;
    if (size < n) {
        size = (n + 31) / 32 * 32;
        buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, size * 2)));
    }
    return buffer.get();
}

// A tile of 1 .. kRows rows on vdpbf16ps (tile_pairs), R a compile-time constant.
template <int R = 1>
void pairs_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy,
                int valid, const uint16_t* bias) {
    if (rows == R)
        tile_pairs<R>(x, ldx, w, K, y, ldy, valid, bias);
    else if constexpr (R < kRows)
        pairs_rows<R + 1>(rows, x, ldx, w, K, y, ldy, valid, bias);
}

// Without AMX: each panel unpacked whole, then the pairs layout's vdpbf16ps tiles over it, tile by tile of
// rows as linear() takes the bf16 pairs panels (so the same bits as that linear over the unpacked weights).
template <typename Dequant>
void linear_weight_only_pairs(const uint16_t* x, int64_t ldx, Dequant dequant, const uint16_t* bias, uint16_t* y,
                              int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel, tiles = (M + kRows - 1) / kRows;
    auto first_row = [&](int64_t t) { return M * t / tiles; };
#pragma omp parallel num_threads(num_threads) if (num_panels > 1)
    {
        uint16_t* w = thread_buffer(size_t(K * kPanel));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            const int64_t n0 = p * kPanel;
            dequant(p, 0, K, w);
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t m0 = first_row(t);
                pairs_rows(int(first_row(t + 1) - m0), x + m0 * ldx, ldx, w, K, y + m0 * N + n0, N,
                           int(std::min<int64_t>(kPanel, N - n0)), bias ? bias + n0 : nullptr);
            }
        }
    }
}

#if defined(ITERSERVE_LINEAR_AMX)
// Tiles 0-1 (rows of x0) and, with Two, 2-3 (rows of x1) += 16 rows each @ a panel's bf16 pairs w, inputs 0 .. K
// (x0 and x1 at the same input as w).
template <bool Two>
inline void amx_accumulate(const uint16_t* x0, int64_t ld0, const uint16_t* x1, int64_t ld1, const uint16_t* w,
                           int64_t K) {
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* wk = w + k * kPanel;
        _tile_loadd(6, wk, 128);
        _tile_loadd(7, wk + 32, 128);
        _tile_loadd(4, x0 + k, ld0 * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (Two) {
            _tile_loadd(5, x1 + k, ld1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

inline void zero_tiles() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

inline void store_tiles(float* c) {  // all four: c[32][kPanel]
    _tile_stored(0, c, kPanel * 4);
    _tile_stored(1, c + 16, kPanel * 4);
    _tile_stored(2, c + 16 * kPanel, kPanel * 4);
    _tile_stored(3, c + 16 * kPanel + 16, kPanel * 4);
}

// x [M, K] (rows ldx apart) @ W^T (+ bias) -> y [M, N], all bfloat16, W's panels as `dequant` unpacks them
// (dequant(p, k0, k1, out): panel p's inputs k0 .. k1 into out, in pairs); y = scale * sums where scale (one
// float32 an output) is given. K a multiple of 32. Rows past the last whole 16 are copied once, zero-padded,
// as linear_amx does.
template <typename Dequant>
void linear_weight_only_bf16(const uint16_t* x, int64_t ldx, Dequant dequant, const float* scale, const uint16_t* bias,
                            uint16_t* y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel, whole = M / 16 * 16, tail = M - whole;
    if (M == 0) return;  // no rows: no block to load, not even a padded one
    const uint16_t* tail_x = padded_tail(x, ldx, whole, tail, K);
#pragma omp parallel num_threads(num_threads) if (num_panels > 1)
    {
        configure_tiles();
        alignas(64) float c[32 * kPanel];
        const int64_t depth = M <= 32 ? std::min(K, kDequantDepth) : K;
        uint16_t* w = thread_buffer(size_t(depth * kPanel));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            const int64_t n0 = p * kPanel;
            const int valid = int(std::min<int64_t>(kPanel, N - n0));
            const uint16_t* b = bias ? bias + n0 : nullptr;
            const float* s = scale ? scale + n0 : nullptr;
            if (M <= 32) {  // one block of 16 or 32 rows, the panel depth by depth
                const uint16_t* x0 = whole >= 16 ? x : tail_x;
                const uint16_t* x1 = whole >= 32 ? x + 16 * ldx : tail_x;
                const int64_t ld0 = whole >= 16 ? ldx : K, ld1 = whole >= 32 ? ldx : K;
                zero_tiles();
                for (int64_t k0 = 0; k0 < K; k0 += depth) {
                    const int64_t k1 = std::min(K, k0 + depth);
                    dequant(p, k0, k1, w);
                    if (M > 16)
                        amx_accumulate<true>(x0 + k0, ld0, x1 + k0, ld1, w, k1 - k0);
                    else
                        amx_accumulate<false>(x0 + k0, ld0, nullptr, 0, w, k1 - k0);
                }
                store_tiles(c);
                store_block(c, int(std::min<int64_t>(M, 16)), y + n0, N, valid, b, s);
                if (M > 16) store_block(c + 16 * kPanel, int(M - 16), y + 16 * N + n0, N, valid, b, s);
                continue;
            }
            dequant(p, 0, K, w);
            int64_t m0 = 0;
            for (; m0 + 32 <= whole; m0 += 32) {
                zero_tiles();
                amx_accumulate<true>(x + m0 * ldx, ldx, x + (m0 + 16) * ldx, ldx, w, K);
                store_tiles(c);
                store_block(c, 32, y + m0 * N + n0, N, valid, b, s);
            }
            const bool two = m0 < whole && tail;  // the last whole 16 with the tail
            if (m0 < whole || tail) {
                zero_tiles();
                const uint16_t* x0 = m0 < whole ? x + m0 * ldx : tail_x;
                if (two)
                    amx_accumulate<true>(x0, ldx, tail_x, K, w, K);
                else
                    amx_accumulate<false>(x0, m0 < whole ? ldx : K, nullptr, 0, w, K);
                store_tiles(c);
                const int first = int(m0 < whole ? 16 : tail);
                store_block(c, first, y + m0 * N + n0, N, valid, b, s);
                if (two) store_block(c + 16 * kPanel, int(tail), y + (m0 + 16) * N + n0, N, valid, b, s);
            }
        }
        _tile_release();
    }
}
#endif
#endif

}  // namespace
