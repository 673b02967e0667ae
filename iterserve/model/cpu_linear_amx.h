// The linear layer over bf16 pairs panels on AMX tiles (linear_amx).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_linear_avx512.h"

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

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

// c's first `rows` rows (times each column's scale, where given; + bias) rounded to bfloat16 into y's rows,
// the panel's `valid` first columns.
void store_block(const float* c, int rows, uint16_t* y, int64_t ldy, int valid, const uint16_t* bias,
                 const float* scale = nullptr) {
    const __mmask16 lo = valid >= 16 ? 0xffff : __mmask16((1u << valid) - 1);
    const __mmask16 hi = valid >= 32 ? 0xffff : valid <= 16 ? 0 : __mmask16((1u << (valid - 16)) - 1);
    const __m512 b0 = bias ? load_masked(bias, lo) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_masked(bias + 16, hi) : _mm512_setzero_ps();
    const __m512 s0 = scale ? _mm512_maskz_loadu_ps(lo, scale) : _mm512_set1_ps(1.0f);
    const __m512 s1 = scale ? _mm512_maskz_loadu_ps(hi, scale + 16) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < rows; ++r) {
        store_masked(y + r * ldy, lo, _mm512_fmadd_ps(_mm512_loadu_ps(c + r * kPanel), s0, b0));
        store_masked(y + r * ldy + 16, hi, _mm512_fmadd_ps(_mm512_loadu_ps(c + r * kPanel + 16), s1, b1));
    }
}

// The pairs layout's linear on AMX tiles (K a multiple of 32): each thread takes a run of panels, as
// linear() does, and goes over x in blocks of 32 rows, then 16; a last partial block of 16 is copied
// once, zero-padded, so every tile load is a whole tile.
// x's `tail` rows from row `whole` on, copied into a block of 16 rows of K, zero-padded (K apart), so the last
// partial block loads as whole tiles; the block is this thread's, kept between calls.
const uint16_t* padded_tail(const uint16_t* x, int64_t ldx, int64_t whole, int64_t tail, int64_t K) {
    static thread_local std::vector<uint16_t> padded;
    if (tail) {
        padded.assign(size_t(16 * K), 0);
        for (int64_t r = 0; r < tail; ++r) std::memcpy(&padded[size_t(r * K)], x + (whole + r) * ldx, size_t(K) * 2);
    }
    return padded.data();
}

void linear_amx(const uint16_t* x, int64_t ldx, const uint16_t* panels, const uint16_t* bias, uint16_t* y, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel, whole = M / 16 * 16, tail = M - whole;
    const uint16_t* tail_x = padded_tail(x, ldx, whole, tail, K);
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

}  // namespace
