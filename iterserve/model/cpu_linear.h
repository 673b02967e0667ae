// What the linear kernels share (see cpu_linear.cpp's top): the panel width and the quantized layers' driver.
#pragma once

#include <algorithm>

#include "cpu_common.h"

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ITERSERVE_LINEAR 1
#endif

constexpr int kPanel = 32;           // outputs per panel: two AVX-512 vectors, or four AVX2 ones
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the weight stream
// The weight-only int4 panels (cpu_linear_weight_only.h describes them; AVX2 and AMX read the same): groups of
// kInt4Group inputs, each its codes (half a byte) and its kPanel bf16 scales and minimums.
constexpr int kInt4Group = 32;
constexpr int64_t kInt4GroupBytes = kInt4Group * kPanel / 2 + 2 * kPanel * 2;

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

}  // namespace
