// The elementwise ops of a Llama layer, fused, for the CPU path (see cpu_kernels.py); also the
// K/V cache write and the greedy argmax, which torch's index_copy_ / max do several times slower.
//
// In torch each is 3-8 ops over the whole batch (RMSNorm alone: widen, square, mean, rsqrt, scale,
// narrow, weight), each a pass over memory plus ~5-20 us of dispatch: ~17 ms of a 100 ms decode step
// at batch 64, measured. Here each is one pass. Results are rounded to the model dtype where torch's
// op-by-op code rounds, so they match it up to the last float bit of a sum or an exp (which can flip
// a bf16 rounding now and then). Built with -ffp-contract=off: a fused multiply-add would round
// differently from torch's separate ops.
#include <algorithm>
#include <cfloat>

#include "cpu_common.h"

namespace {

// e^x for x <= 0 (silu's e^-|x|), written so the compiler vectorizes the loop around it (a call to
// expf would not be): 2^n * 2^f, |f| <= 1/2, degree-6 Taylor of 2^f; relative error ~1e-7.
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504f;
    const float n = (t - 12582912.f) + 12582912.f;  // round to nearest: 1.5 * 2^23 pushes the fraction out
    const float f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.f;
    const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

constexpr int64_t kParallelMin = 1 << 15;  // elements: below this, a thread team costs more than it saves

// out = weight * narrow(x / sqrt(mean(x^2) + eps)), per row, in float32 then rounded as torch does.
// With residual: residual += x first (rounded), and the sum is what is normalized.
template <typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * cols;
        T* res = residual ? residual + r * cols : nullptr;
        T* o = out + r * cols;
        if (res)
            for (int64_t c = 0; c < cols; ++c) from_f32(to_f32(xr[c]) + to_f32(res[c]), &res[c]);
        const T* src = res ? res : xr;
        float lanes[16] = {};  // 16 running sums in a fixed order: vectorizes, and is deterministic
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16)
            for (int k = 0; k < 16; ++k) lanes[k] += to_f32(src[c + k]) * to_f32(src[c + k]);
        for (; c < cols; ++c) lanes[0] += to_f32(src[c]) * to_f32(src[c]);
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) sum += lanes[k];
        const float inv = 1.f / std::sqrt(sum / float(cols) + eps);
        c = 0;
#if defined(__AVX512F__)
        for (; c + 16 <= cols; c += 16)
            store16(o + c, _mm512_mul_ps(load16(weight + c), round_trip16<T>(_mm512_mul_ps(load16(src + c), _mm512_set1_ps(inv)))));
#endif
        for (; c < cols; ++c) from_f32(to_f32(weight[c]) * round_trip<T>(to_f32(src[c]) * inv), o + c);
    }
}

// Rotary embedding in place on the first `heads` heads of each row (q then k in a fused qkv row),
// rotate-half layout: x*cos + rotate_half(x)*sin, each product and the sum rounded like torch's ops.
template <typename T>
void rope(T* x, int64_t rows, int64_t row_stride, int heads, int head_dim, const T* cos, const T* sin,
          const int64_t* positions) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + positions[r] * head_dim;
        const T* s = sin + positions[r] * head_dim;
        for (int h = 0; h < heads; ++h) {
            T* v = x + r * row_stride + int64_t(h) * head_dim;
            float lo[512], hi[512];  // head_dim <= 1024, checked by the caller
            for (int i = 0; i < half; ++i) {
                const float a = to_f32(v[i]), b = to_f32(v[i + half]);
                lo[i] = round_trip<T>(round_trip<T>(a * to_f32(c[i])) + round_trip<T>(-b * to_f32(s[i])));
                hi[i] = round_trip<T>(round_trip<T>(b * to_f32(c[i + half])) + round_trip<T>(a * to_f32(s[i + half])));
            }
            for (int i = 0; i < half; ++i) {
                from_f32(lo[i], v + i);
                from_f32(hi[i], v + i + half);
            }
        }
    }
}

// gate_up [rows, 2 * n] -> out [rows, n] = narrow(silu(gate)) * up, rounded after each op as torch does.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * n;
        const T* u = g + n;
        T* o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            const __m512 a = load16(g + i);
            const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
            const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(_mm512_set1_ps(1.f), neg, e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
            store16(o + i, _mm512_mul_ps(round_trip16<T>(_mm512_mul_ps(a, sig)), load16(u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)  // the loop below does not vectorize: 8 lanes by hand
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 a = load8(g + i);
            const __m256 neg = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 e = exp8(_mm256_or_ps(a, _mm256_set1_ps(-0.f)));  // e^-|a|
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
            store8(o + i, _mm256_mul_ps(round_trip8<T>(_mm256_mul_ps(a, sig)), load8(u + i)));
        }
#endif
        for (; i < n; ++i) {
            const float a = to_f32(g[i]);
            const float e = exp_nonpositive(a < 0.f ? a : -a);  // e^-|a|: no overflow either way
            const float sig = (a < 0.f ? e : 1.f) / (1.f + e);
            from_f32(round_trip<T>(a * sig) * to_f32(u[i]), o + i);
        }
    }
}

// The first index of each row's maximum (a NaN counts as the maximum, as in torch). 16 lanes each
// keep their running maximum and where they first saw it, which vectorizes; the lowest index among
// the lanes holding the winner is the first occurrence.
template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t cols, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * cols;
        float lanes[16];
        int32_t at[16] = {};  // int32, like the floats: one vector each (a row is under 2^31 long)
        int32_t nan[16] = {};
        for (int k = 0; k < 16; ++k) lanes[k] = -INFINITY;
        int64_t c = 0;
#if defined(__AVX512F__)  // gcc does not vectorize the loop below (measured: 1.2 ms for 64 x 49k bf16)
        __m512 best16 = _mm512_set1_ps(-INFINITY);
        __m512i at16 = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan16 = 0;
        for (; c + 16 <= cols; c += 16) {
            const __m512 v = load16(xr + c);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best16, _CMP_GT_OQ);
            best16 = _mm512_mask_mov_ps(best16, gt, v);
            at16 = _mm512_mask_mov_epi32(at16, gt, idx);
            nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        _mm512_storeu_ps(lanes, best16);
        _mm512_storeu_si512(at, at16);
        nan[0] = nan16 != 0;
#elif defined(__AVX2__)  // the same 16 lanes as two 8-lane halves
        __m256 best8[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)}, nan8 = _mm256_setzero_ps();
        __m256i at8[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i idx[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
        for (; c + 16 <= cols; c += 16)
            for (int h = 0; h < 2; ++h) {
                const __m256 v = load8(xr + c + 8 * h);
                const __m256 gt = _mm256_cmp_ps(v, best8[h], _CMP_GT_OQ);
                best8[h] = _mm256_blendv_ps(best8[h], v, gt);
                at8[h] = _mm256_blendv_epi8(at8[h], idx[h], _mm256_castps_si256(gt));
                nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                idx[h] = _mm256_add_epi32(idx[h], _mm256_set1_epi32(16));
            }
        for (int h = 0; h < 2; ++h) {
            _mm256_storeu_ps(lanes + 8 * h, best8[h]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 8 * h), at8[h]);
        }
        nan[0] = _mm256_movemask_ps(nan8) != 0;
#endif
        for (; c + 16 <= cols; c += 16)
            for (int k = 0; k < 16; ++k) {
                const float v = to_f32(xr[c + k]);
                at[k] = v > lanes[k] ? int32_t(c) + k : at[k];
                lanes[k] = v > lanes[k] ? v : lanes[k];
                nan[k] |= v != v;
            }
        float best = -INFINITY;
        int64_t best_at = 0;
        bool any_nan = false;
        for (int k = 0; k < 16; ++k) {
            any_nan |= nan[k] != 0;
            if (lanes[k] > best || (lanes[k] == best && at[k] < best_at)) best = lanes[k], best_at = at[k];
        }
        for (; c < cols; ++c) {  // the tail comes after every lane's elements
            const float v = to_f32(xr[c]);
            if (v > best) best = v, best_at = c;
            any_nan |= v != v;
        }
        if (any_nan)
            for (best_at = 0; to_f32(xr[best_at]) == to_f32(xr[best_at]);) ++best_at;
        out[r] = best_at;
    }
}

// Copy this step's K and V rows ([T, row] with rows k_stride / v_stride apart) into the paged
// cache at slot_mapping; a negative slot (padding) is skipped.
inline void write_kv(const char* k, int64_t k_stride, const char* v, int64_t v_stride, char* k_cache, char* v_cache,
                     const int64_t* slot_mapping, int64_t rows, int64_t row_bytes) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        std::memcpy(k_cache + slot * row_bytes, k + r * k_stride, size_t(row_bytes));
        std::memcpy(v_cache + slot * row_bytes, v + r * v_stride, size_t(row_bytes));
    }
}

// write_kv into a bfloat16 cache in the pair layout (cpu_attention.cpp's attend_pairs): within a block
// of block_size positions, a kv head's K is [D/2][block_size][2] and its V [block_size/2][D][2]. Rows
// k_stride / v_stride elements apart; a negative slot (padding) is skipped.
inline void write_kv_pairs(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* k_cache,
                           uint16_t* v_cache, const int64_t* slot_mapping, int64_t rows, int kv_heads, int head_dim,
                           int block_size) {
    const int64_t head_block = int64_t(block_size) * head_dim, block = kv_heads * head_block;
    // A token's K touches a line per dimension pair: ask for every line first (for writing), so the
    // misses overlap instead of each store waiting for its own.
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        const int64_t b = slot / block_size, i = slot % block_size;
        for (int h = 0; h < kv_heads; ++h) {
            const char* kb = reinterpret_cast<const char*>(k_cache + b * block + h * head_block + 2 * i);
            for (int d = 0; d < head_dim / 2; ++d) __builtin_prefetch(kb + d * 4 * block_size, 1, 3);
            __builtin_prefetch(v_cache + b * block + h * head_block + (i / 2) * 2 * head_dim, 1, 3);
        }
    }
#if defined(__AVX512BW__)  // head_dim a multiple of 32, as the layout's reader asks (pairs_supported)
    // a scatter for K's pairs (16 of them a vector), masked stores for V's every other half-word
    const __m512i lines = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(2 * block_size));
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        const int64_t b = slot / block_size, i = slot % block_size;
        for (int h = 0; h < kv_heads; ++h) {
            const uint16_t *kr = k + r * k_stride + h * head_dim, *vr = v + r * v_stride + h * head_dim;
            uint16_t* kb = k_cache + b * block + h * head_block + 2 * i;  // dims (2d, 2d+1) at [d][i]
            uint16_t* vb = v_cache + b * block + h * head_block + (i / 2) * 2 * head_dim;  // dim d at [d][i & 1]
#if defined(__AVX512BW__)
            const __mmask32 half = (i & 1) ? 0xaaaaaaaau : 0x55555555u;
            for (int d = 0; d < head_dim; d += 32) {
                _mm512_i32scatter_epi32(kb + d * block_size, lines, _mm512_loadu_si512(kr + d), 2);
                for (int c = d; c < d + 32; c += 16) {
                    const __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + c));
                    __m512i wide = _mm512_cvtepu16_epi32(row);
                    if (i & 1) wide = _mm512_slli_epi32(wide, 16);
                    _mm512_mask_storeu_epi16(vb + 2 * c, half, wide);
                }
            }
#else
            for (int d = 0; d < head_dim / 2; ++d) std::memcpy(kb + d * 2 * block_size, kr + 2 * d, 4);
            for (int d = 0; d < head_dim; ++d) vb[2 * d + (i & 1)] = vr[d];
#endif
        }
    }
}

// write_kv from float32 rows into a bfloat16 cache (--dtype bf16-storage), rounded as torch rounds;
// strides and row width in elements.
inline void write_kv_bf16(const float* k, int64_t k_stride, const float* v, int64_t v_stride, uint16_t* k_cache,
                          uint16_t* v_cache, const int64_t* slot_mapping, int64_t rows, int64_t row_elems) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        for (int64_t i = 0; i < row_elems; ++i) {
            from_f32(k[r * k_stride + i], k_cache + slot * row_elems + i);
            from_f32(v[r * v_stride + i], v_cache + slot * row_elems + i);
        }
    }
}

// One (token, kv head) into an int8 cache (--kv-cache-dtype int8, kv_quant.py): head_dim values
// round(x / scale), scale = max(absmax / 127, FLT_MIN), then the scale's 4 bytes. The same float32
// division and half-to-even rounding as torch's quantize_kv, so both write the same bytes.
template <typename T>
inline void quantize_head(const T* x, int head_dim, int8_t* out) {
    float absmax = 0.f;
    for (int d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(to_f32(x[d])));
    const float scale = std::max(absmax / 127.f, FLT_MIN);
    for (int d = 0; d < head_dim; ++d)
        out[d] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(to_f32(x[d]) / scale))));
    std::memcpy(out + head_dim, &scale, 4);
}

// write_kv into int8 caches [slots, heads, head_dim + 4]; k/v rows k_stride / v_stride elements apart.
template <typename T>
void write_kv_int8(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int8_t* k_cache, int8_t* v_cache,
                   const int64_t* slot_mapping, int64_t rows, int heads, int head_dim) {
    const int64_t width = head_dim + 4, row = heads * width;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        for (int h = 0; h < heads; ++h) {
            quantize_head(k + r * k_stride + h * head_dim, head_dim, k_cache + slot * row + h * width);
            quantize_head(v + r * v_stride + h * head_dim, head_dim, v_cache + slot * row + h * width);
        }
    }
}

}  // namespace

extern "C" {

void iterserve_argmax_rows(int dtype, const void* x, int64_t rows, int64_t cols, int64_t* out) {
    if (dtype == 0)
        argmax_rows(static_cast<const float*>(x), rows, cols, out);
    else
        argmax_rows(static_cast<const uint16_t*>(x), rows, cols, out);
}

// Strides in bytes.
void iterserve_write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                        void* v_cache, const int64_t* slot_mapping, int64_t rows, int64_t row_bytes) {
    write_kv(static_cast<const char*>(k), k_stride, static_cast<const char*>(v), v_stride, static_cast<char*>(k_cache),
             static_cast<char*>(v_cache), slot_mapping, rows, row_bytes);
}

void iterserve_write_kv_pairs(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                              void* v_cache, const int64_t* slot_mapping, int64_t rows, int kv_heads, int head_dim,
                              int block_size) {
    write_kv_pairs(static_cast<const uint16_t*>(k), k_stride, static_cast<const uint16_t*>(v), v_stride,
                   static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slot_mapping, rows, kv_heads,
                   head_dim, block_size);
}
void iterserve_write_kv_bf16(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                             void* v_cache, const int64_t* slot_mapping, int64_t rows, int64_t row_elems) {
    write_kv_bf16(static_cast<const float*>(k), k_stride, static_cast<const float*>(v), v_stride,
                  static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slot_mapping, rows, row_elems);
}

// Strides in elements; dtype of k/v as below; caches int8 [slots, heads, head_dim + 4].
void iterserve_write_kv_int8(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                             void* k_cache, void* v_cache, const int64_t* slot_mapping, int64_t rows, int heads,
                             int head_dim) {
    auto* kc = static_cast<int8_t*>(k_cache);
    auto* vc = static_cast<int8_t*>(v_cache);
    if (dtype == 0)
        write_kv_int8(static_cast<const float*>(k), k_stride, static_cast<const float*>(v), v_stride, kc, vc,
                      slot_mapping, rows, heads, head_dim);
    else
        write_kv_int8(static_cast<const uint16_t*>(k), k_stride, static_cast<const uint16_t*>(v), v_stride, kc, vc,
                      slot_mapping, rows, heads, head_dim);
}


// dtype: 0 float32, 1 bfloat16. Every tensor contiguous except x in rope (rows row_stride apart).
void iterserve_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out, int64_t rows,
                        int64_t cols, float eps) {
    if (dtype == 0)
        rms_norm(static_cast<const float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
                 static_cast<float*>(out), rows, cols, eps);
    else
        rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, cols, eps);
}

void iterserve_rope(int dtype, void* x, int64_t rows, int64_t row_stride, int heads, int head_dim, const void* cos,
                    const void* sin, const int64_t* positions) {
    if (dtype == 0)
        rope(static_cast<float*>(x), rows, row_stride, heads, head_dim, static_cast<const float*>(cos),
             static_cast<const float*>(sin), positions);
    else
        rope(static_cast<uint16_t*>(x), rows, row_stride, heads, head_dim, static_cast<const uint16_t*>(cos),
             static_cast<const uint16_t*>(sin), positions);
}

void iterserve_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n) {
    if (dtype == 0)
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, n);
    else
        silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, n);
}

}
