// LoRA deltas inside the C decode loop (cpu_decode.cpp): each row under its own adapter's slot, from the
// slots' stacks as model/lora.py lays them out. A decode step has few rows and the ranks are small, so a
// row's delta is rank dot products over its input and rank axpys into its output, vectorized by hand.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"

namespace {

constexpr int kMaxLoraColumns = 1024;  // a fused linear's parts * max_rank (cpu_decode.py checks it)

// u[r] = x . a[r * n + 0:n] for r < rows, each rounded to T. Four rows at a time share x's loads and
// keep four sums in flight.
template <typename T> inline void lora_dots(const T* x, const T* a, int64_t n, int rows, float* u) {
    int r = 0;
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {  // bfloat16 pairs multiplied and summed in one instruction
        for (; r + 4 <= rows; r += 4) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t k = 0; k < n; k += 32) {
                const __mmask32 live = n - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - k)) - 1;
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + k);
                for (int q = 0; q < 4; ++q) {
                    const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(live, a + (r + q) * n + k);
                    acc[q] = _mm512_dpbf16_ps(acc[q], xv, av);
                }
            }
            for (int q = 0; q < 4; ++q) u[r + q] = round_trip<T>(_mm512_reduce_add_ps(acc[q]));
        }
    }
#endif
#if defined(__AVX512F__)
    for (; r + 4 <= rows; r += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t k = 0;
        for (; k + 16 <= n; k += 16) {
            const __m512 xv = load16(x + k);
            for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(xv, load16(a + (r + q) * n + k), acc[q]);
        }
        for (int q = 0; q < 4; ++q) {
            float sum = _mm512_reduce_add_ps(acc[q]);
            for (int64_t j = k; j < n; ++j) sum += to_f32(x[j]) * to_f32(a[(r + q) * n + j]);
            u[r + q] = round_trip<T>(sum);
        }
    }
#endif
    for (; r < rows; ++r) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < n; ++k) sum += to_f32(x[k]) * to_f32(a[r * n + k]);
        u[r] = round_trip<T>(sum);
    }
}

// y[0:n] += sum over r of u[r] * b[r * stride + 0:n], summed in float32 and rounded once.
template <typename T> inline void lora_axpys(const float* u, const T* b, int64_t stride, int rows, T* y, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 64 <= n; j += 64) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int r = 0; r < rows; ++r) {
            const __m512 ur = _mm512_set1_ps(u[r]);
            const T* br = b + r * stride + j;
            for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(ur, load16(br + 16 * q), acc[q]);
        }
        for (int q = 0; q < 4; ++q) store16(y + j + 16 * q, _mm512_add_ps(load16(y + j + 16 * q), acc[q]));
    }
#endif
    for (; j < n; ++j) {
        float acc = 0.f;
        for (int r = 0; r < rows; ++r) acc += u[r] * to_f32(b[r * stride + j]);
        from_f32(to_f32(y[j]) + acc, y + j);
    }
}

// y[i] += (x[i] A[s]^T) B[s] for each row i whose slot s = slots[i] is not -1: A [slots, parts * rank, in],
// B [slots, parts * rank, out], the scale folded into B, part p's rank rows writing only its own widths[p]
// output columns (B is block diagonal: the rest is zeros, skipped). x A^T is rounded to the model's dtype
// before the second product and that product added into y once, as the Python path's matmul and addmm do.
template <typename T>
void lora_add(const T* x, int64_t in, T* y, const int64_t* widths, int parts, const T* a, const T* b, int rank,
              const int32_t* slots, int64_t m, int num_threads) {
    int64_t out = 0;
    for (int p = 0; p < parts; ++p) out += widths[p];
    const int cols = parts * rank;
#pragma omp parallel for num_threads(int(std::min<int64_t>(num_threads, m))) schedule(static)
    for (int64_t i = 0; i < m; ++i) {
        if (slots[i] < 0) continue;
        const T *xi = x + i * in, *as = a + int64_t(slots[i]) * cols * in, *bs = b + int64_t(slots[i]) * cols * out;
        float u[kMaxLoraColumns];
        lora_dots(xi, as, in, cols, u);
        int64_t lo = 0;
        for (int p = 0; p < parts; ++p) {
            lora_axpys(u + p * rank, bs + p * rank * out + lo, out, rank, y + i * out + lo, widths[p]);
            lo += widths[p];
        }
    }
}

}  // namespace
