// Attention kernels for the CPU path (see cpu_kernels.py): decode straight from the paged KV cache,
// and causal prompt attention (further down).
//
// Decode: one query token per sequence attends to its whole context, read through its block table
// in place: no gather into a padded buffer (which moved every K/V byte three times), one pass over
// K and one over V, in float32 with the softmax taken over the whole row. The portable loops take
// (sequence, kv head) pairs as work items; the AVX-512 and AVX2 paths slices of kSlice positions of a
// sequence (attend_seq), merged after (decode_simd).
//
// A windowed layer (sliding-window attention) reads only the blocks that reach into each sequence's
// window: the table and length handed to the per-sequence code start at the block holding the
// window's first position, and the positions of that block before it (`skip`) are masked.
// Gemma 2's soft-capping (cap * tanh(score / cap)) is one more pass over the scores.
//
// An int8 cache (--kv-cache-dtype int8, kv_quant.py) goes through the same code with the cache's
// element type as a template parameter (KV): each head's row is head_dim int8 values and their
// float32 scale; values are widened in registers (K to int16 against a bf16 query quantized to int16,
// an integer dot product), K's scale multiplies the scores of its position and V's the probability
// that weighs its row. Nothing is dequantized into memory.
//
// Plain C ABI, no torch headers, so it builds in about a second; OpenMP resolves to the libgomp
// torch has already loaded, so it shares torch's thread pool instead of starting a second one.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxHeads = 64;  // query heads, for the AVX-512 path's register tiles
constexpr int kSlice = 512;  // positions per slice of a context (whole blocks): shorter ones save less than their merge
constexpr int kMaxSlices = 64;

// How the cache holds one (position, kv head): head_dim values in the model dtype, or, in an int8
// cache, head_dim int8 values followed by their float32 scale (`extra` elements more per head).
template <typename KV> struct CacheRow {
    static constexpr int extra = 0;
    static constexpr bool quantized = false;
    static float scale(const KV*, int) { return 1.f; }
};
template <> struct CacheRow<int8_t> {
    static constexpr int extra = 4;
    static constexpr bool quantized = true;
    static float scale(const int8_t* head, int head_dim) {
        float s;
        std::memcpy(&s, head + head_dim, 4);
        return s;
    }
};

inline float to_f32(int8_t x) { return float(x); }

// The scores of one head after Q.K: soft-capped, and the first `skip` positions (behind the window) masked.
inline void cap_and_mask(float* s, int n, int skip, float softcap) {
    for (int p = 0; p < skip && p < n; ++p) s[p] = -INFINITY;
    if (softcap > 0.f)
        for (int p = skip; p < n; ++p) s[p] = softcap * std::tanh(s[p] / softcap);
}

template <typename T, typename KV>
void attend_one(const T* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int seq_len,
                T* out, int num_kv_heads, int group, int head_dim, int block_size, float scale, int h,
                std::vector<float>& scores, int skip, float softcap) {
    const int D = head_dim, G = group, W = D + CacheRow<KV>::extra;
    const size_t row = size_t(num_kv_heads) * W;  // elements per cache slot
    float qf[kMaxGroup * kMaxHeadDim];
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_f32(q[(h * G + g) * D + d]) * scale;
    scores.resize(size_t(G) * seq_len);
    float mx[kMaxGroup];
    for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
    for (int p0 = 0; p0 < seq_len; p0 += block_size) {
        const KV* kb = k_cache + size_t(table[p0 / block_size]) * block_size * row + size_t(h) * W;
        const int n = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int i = 0; i < n; ++i) {
            const KV* k = kb + i * row;
            const float ks = CacheRow<KV>::scale(k, D);
            for (int g = 0; g < G; ++g) {
                const float* qg = qf + g * D;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int d = 0; d < D; ++d) acc += qg[d] * to_f32(k[d]);
                acc *= ks;
                scores[size_t(g) * seq_len + p0 + i] = acc;
                mx[g] = acc > mx[g] ? acc : mx[g];
            }
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < G; ++g) {
            float* s = scores.data() + size_t(g) * seq_len;
            cap_and_mask(s, seq_len, skip, softcap);
            mx[g] = -INFINITY;
            for (int p = 0; p < seq_len; ++p) mx[g] = s[p] > mx[g] ? s[p] : mx[g];
        }
    float inv[kMaxGroup];
    for (int g = 0; g < G; ++g) {
        float* s = scores.data() + size_t(g) * seq_len;
        float sum = 0.f;
        for (int p = 0; p < seq_len; ++p) { s[p] = std::exp(s[p] - mx[g]); sum += s[p]; }
        inv[g] = 1.f / sum;
    }
    float acc[kMaxGroup * kMaxHeadDim];
    std::memset(acc, 0, sizeof(float) * G * D);
    for (int p0 = 0; p0 < seq_len; p0 += block_size) {
        const KV* vb = v_cache + size_t(table[p0 / block_size]) * block_size * row + size_t(h) * W;
        const int n = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int i = 0; i < n; ++i) {
            const KV* v = vb + i * row;
            const float vs = CacheRow<KV>::scale(v, D);
            for (int g = 0; g < G; ++g) {
                const float w = scores[size_t(g) * seq_len + p0 + i] * vs;
                float* a = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) a[d] += w * to_f32(v[d]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) from_f32(acc[g * D + d] * inv[g], out + (h * G + g) * D + d);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ITERSERVE_SIMD_DECODE 1
// Software prefetch into L2, a row 16 positions ahead of the one being read: scattered blocks
// defeat the hardware prefetcher, and a whole block prefetched at once into L1 runs out of miss
// buffers (measured: K read at ~22 GB/s instead of ~10 over scattered blocks).
inline void prefetch_l2(const void* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T1);
}

// One sequence's cache rows through its block table. fetch<N> gives the K rows of positions p0 ..
// p0 + N - 1 (past the end: the last one; any valid row would do) and prefetches into L2 the rows 16
// positions on: K's, then, past the end of K, V's first ones.
template <typename KV> struct SeqRows {
    const KV *k_cache, *v_cache;
    const int32_t* table;
    int seq_len, block_size;
    size_t row;  // elements per cache slot
    const KV* at(const KV* cache, int p) const {
        return cache + (size_t(table[p / block_size]) * block_size + p % block_size) * row;
    }
    void prefetch(const KV* cache, int p) const { prefetch_l2(at(cache, p), row * sizeof(KV)); }
    void start() const {
        for (int p = 0; p < 16 && p < seq_len; ++p) prefetch(k_cache, p);
    }
    template <int N> void fetch(const KV** rows, int p0) const {
        for (int r = 0; r < N; ++r) {
            rows[r] = at(k_cache, p0 + r < seq_len ? p0 + r : seq_len - 1);
            const int ahead = p0 + r + 16;
            if (ahead < seq_len) prefetch(k_cache, ahead);
            else if (ahead < 2 * seq_len) prefetch(v_cache, ahead - seq_len);
        }
    }
};

#endif

#if defined(__AVX512F__)
// The same computation with AVX-512 for head_dim a multiple of 16 (the common 64 and 128): each
// K/V row is loaded and widened to float once and used by all G query heads; exp is vectorized.

// a[0..15] -> one vector of their 16 horizontal sums, in order: a transpose-and-add tree, ~2 ops
// per sum instead of the ~8 of a reduction each.
// The shuffles move bits, so `add` decides what the lanes hold: float32, or int32 (the __m512i overload).
template <typename Add> inline __m512 reduce16_by(const __m512* a, Add add) {
    __m512 s8[8], s4[4];
    for (int i = 0; i < 8; ++i)
        s8[i] = add(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(s8[2 * i]), y = _mm512_castps_pd(s8[2 * i + 1]);
        s4[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 v1 = add(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88), _mm512_shuffle_f32x4(s4[0], s4[1], 0xDD));
    const __m512 v2 = add(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88), _mm512_shuffle_f32x4(s4[2], s4[3], 0xDD));
    return add(_mm512_shuffle_f32x4(v1, v2, 0x88), _mm512_shuffle_f32x4(v1, v2, 0xDD));
}
inline __m512 reduce16(const __m512* a) {
    return reduce16_by(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}
inline __m512 reduce16(const __m512i* a) {  // int32 lanes in, their float32 sums out
    const __m512 sums = reduce16_by(reinterpret_cast<const __m512*>(a), [](__m512 x, __m512 y) {
        return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
    });
    return _mm512_cvtepi32_ps(_mm512_castps_si512(sums));
}

inline __m512 load16(const int8_t* p) {  // an int8 cache's values, widened
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <int D> inline void widen_row(const int8_t* k, float* dst) {  // an int8 K row for Dot<D, T, float>
    for (int c = 0; c < D / 16; ++c) _mm512_store_ps(dst + 16 * c, load16(k + 16 * c));
}

// q . k partial sums (16 lanes, summed by reduce16) for one row; the query is kept in the form the
// dot wants. `scaled`: the softmax scale is in the query; head_scale(): what each sum is multiplied by.
template <int D, typename T, typename KV> struct Dot {  // float32, or bf16 / int8 widened to float32
    using Partial = __m512;
    __m512 q[D / 16];
    void set(const T* src, float scale) {
        for (int c = 0; c < D / 16; ++c) q[c] = _mm512_mul_ps(load16(src + 16 * c), _mm512_set1_ps(scale));
    }
    __m512 operator()(const KV* k) const {
        __m512 a = _mm512_mul_ps(q[0], load16(k));
        for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(q[c], load16(k + 16 * c), a);
        return a;
    }
    float head_scale() const { return 1.f; }
    static constexpr bool scaled = true;
};
#if defined(__AVX512BF16__)
template <int D> struct Dot<D, uint16_t, uint16_t> {  // bf16 pairs straight from the cache: no widening
    using Partial = __m512;
    __m512bh q[D / 32];
    void set(const uint16_t* src, float) {
        for (int c = 0; c < D / 32; ++c) q[c] = (__m512bh)_mm512_loadu_si512(src + 32 * c);
    }
    __m512 operator()(const uint16_t* k) const {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < D / 32; ++c) a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        return a;
    }
    float head_scale() const { return 1.f; }
    static constexpr bool scaled = false;  // scale applied to the sums
};
#endif
#if defined(__AVX512BW__)
// An int8 cache's Q.K for a bf16 query, in integers: the query quantized to int16 (one scale a head,
// max|q| / 32767: an error far below bf16's own rounding of q), each K row widened to int16 once for
// the group's heads, products summed pairwise into int32 (vpdpwssd; vpmaddwd + add without VNNI).
// Widening K to float32 instead made the kernel compute-bound on an int8 cache (slower than bf16's).
// |sum| <= D * 32767 * 127 < 2^31 for D <= 256.
template <int D> inline void widen_row(const int8_t* k, int16_t* dst) {  // an int8 K row for DotI16
    for (int c = 0; c < D / 32; ++c)
        _mm512_store_si512(dst + 32 * c, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 32 * c))));
}
template <int D> struct DotI16 {
    using Partial = __m512i;
    __m512i q[D / 32];
    float q_scale;
    void set(const uint16_t* src, float scale) {
        __m512 x[D / 16], top = _mm512_setzero_ps();
        for (int c = 0; c < D / 16; ++c) top = _mm512_max_ps(top, _mm512_abs_ps(x[c] = load16(src + 16 * c)));
        const float max_abs = _mm512_reduce_max_ps(top);
        q_scale = max_abs / 32767.f * scale;
        const __m512 to_int = _mm512_set1_ps(max_abs > 0.f ? 32767.f / max_abs : 0.f);
        alignas(64) int16_t q16[D];
        for (int c = 0; c < D / 16; ++c)
            _mm256_store_si256(reinterpret_cast<__m256i*>(q16 + 16 * c),
                               _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[c], to_int))));
        for (int c = 0; c < D / 32; ++c) q[c] = _mm512_load_si512(q16 + 32 * c);
    }
    __m512i operator()(const int16_t* k) const {
        __m512i a = _mm512_setzero_si512();
        for (int c = 0; c < D / 32; ++c) {
            const __m512i kc = _mm512_load_si512(k + 32 * c);
#if defined(__AVX512VNNI__)
            a = _mm512_dpwssd_epi32(a, q[c], kc);
#else
            a = _mm512_add_epi32(a, _mm512_madd_epi16(q[c], kc));
#endif
        }
        return a;
    }
    float head_scale() const { return q_scale; }
    static constexpr bool scaled = true;  // in q_scale
};
#endif

// Each head's scores s[g][0 .. seq_len) -> exp(score - the head's max), zeros after them up to padded (a
// multiple of 16); inv[g] = 1 / their sum. With `part` (see attend_seq) each head's max and sum too.
template <int D>
inline void softmax_heads(float* s, int H, int padded, int seq_len, float* inv, float* part) {
    auto live = [&](int p) {  // which of positions p .. p + 15 are in the sequence
        return p >= seq_len ? __mmask16(0) : seq_len - p >= 16 ? __mmask16(0xffff) : __mmask16((1u << (seq_len - p)) - 1u);
    };
    for (int g = 0; g < H; ++g) {
        float* sg = s + size_t(g) * padded;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int p = 0; p < seq_len; p += 16) m = _mm512_mask_max_ps(m, live(p), m, _mm512_loadu_ps(sg + p));
        const float max_score = _mm512_reduce_max_ps(m);
        const __m512 mx = _mm512_set1_ps(max_score);
        __m512 sum = _mm512_setzero_ps();
        for (int p = 0; p < padded; p += 16) {
            const __mmask16 k = live(p);
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + p), mx)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(sg + p, e);
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[g] = 1.f / total;
        if (part) {
            part[size_t(H) * D + 2 * g] = max_score;
            part[size_t(H) * D + 2 * g + 1] = total;
        }
    }
}

// Each head's P.V sums acc[g] (64-byte aligned) times inv[g]: to out in T, or with `part` to it in float32.
template <int D, typename T>
inline void store_heads(const float* acc, const float* inv, int H, T* out, float* part) {
    for (int g = 0; g < H; ++g)
        for (int c = 0; c < D / 16; ++c) {
            const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc + g * D + 16 * c), _mm512_set1_ps(inv[g]));
            if (part)
                _mm512_storeu_ps(part + g * D + 16 * c, o);
            else
                store16(out + g * D + 16 * c, o);
        }
}

// One sequence (or one slice of it), all heads. The K pass reads each cache slot (all kv heads of one
// position) whole and in order and scores 16 positions per vector; the P.V pass goes block by block
// (below). With `part` (a slice of a split context, see decode_simd) the result goes there in
// float32 instead of to out, [H][D] normalized within the slice, then each head's score max and
// exp-sum: [H][2].
template <int D, typename T, typename KV>
void attend_seq(const T* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int seq_len,
                       T* out, int num_kv_heads, int G, int block_size, float scale, std::vector<float>& scores,
                       int skip, float softcap, float* part = nullptr) {
    constexpr int C = D / 16, W = D + CacheRow<KV>::extra;
    constexpr bool quantized = CacheRow<KV>::quantized;
    const int H = num_kv_heads * G;
    const size_t row = size_t(num_kv_heads) * W;  // elements per cache slot
    // An int8 cache's K rows are widened once per 16 positions and kv head, into `wide` (in L1), for
    // all G query heads: widening inside each head's dot would repeat it G times. Under a bf16 query
    // they are widened to int16 for the integer dot (DotI16), else to float32.
#if defined(__AVX512BW__)
    constexpr bool int_dot = quantized && std::is_same_v<T, uint16_t>;
    using KDot = std::conditional_t<int_dot, DotI16<D>, std::conditional_t<quantized, Dot<D, T, float>, Dot<D, T, KV>>>;
#else
    constexpr bool int_dot = false;
    using KDot = std::conditional_t<quantized, Dot<D, T, float>, Dot<D, T, KV>>;
#endif
    using Wide = std::conditional_t<int_dot, int16_t, float>;
    alignas(64) Wide wide[quantized ? 16 * D : 1];
    KDot dots[kMaxHeads];
    for (int j = 0; j < H; ++j) dots[j].set(q + j * D, scale);
    const __m512 post_scale = _mm512_set1_ps(KDot::scaled ? 1.f : scale);
    const int padded = (seq_len + 15) & ~15;
    scores.resize(size_t(H) * padded);
    float* s = scores.data();
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    const SeqRows<KV> seq{k_cache, v_cache, table, seq_len, block_size, row};
    seq.start();
    const KV* rows[16];
    typename KDot::Partial partial[16];
    for (int p0 = 0; p0 < seq_len; p0 += 16) {  // 16 positions at a time, one score per lane
        seq.template fetch<16>(rows, p0);
        for (int h = 0; h < num_kv_heads; ++h) {
            auto score = [&](auto row_of, __m512 row_scale) {  // this kv head's query heads on the 16 rows
                for (int g = h * G; g < (h + 1) * G; ++g) {
                    for (int r = 0; r < 16; ++r) partial[r] = dots[g](row_of(r));
                    _mm512_storeu_ps(s + size_t(g) * padded + p0,
                                     _mm512_mul_ps(reduce16(partial), _mm512_mul_ps(row_scale, _mm512_set1_ps(dots[g].head_scale()))));
                }
            };
            if constexpr (quantized) {
                alignas(64) float ks[16];  // the 16 positions' K scales, one per lane
                for (int r = 0; r < 16; ++r) {
                    const KV* k = rows[r] + h * W;
                    widen_row<D>(k, wide + r * D);
                    ks[r] = CacheRow<KV>::scale(k, D);
                }
                score([&](int r) { return static_cast<const Wide*>(wide + r * D); },
                      _mm512_mul_ps(_mm512_load_ps(ks), post_scale));
            } else {
                score([&](int r) { return rows[r] + h * W; }, post_scale);
            }
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < H; ++g) cap_and_mask(s + size_t(g) * padded, seq_len, skip, softcap);
    float inv[kMaxHeads];
    softmax_heads<D>(s, H, padded, seq_len, inv, part);
    // P.V block by block: every kv head's tiles of query heads (accumulators in registers within a
    // block; all of SmolLM's 9 x 4 would not fit in 32) sweep a V block while it is in cache, so
    // reading V overlaps the arithmetic of every head. Sweeping one kv head over the whole context
    // at a time left the second and third sweeps without memory traffic (measured: 10-13% slower
    // kernel). The first tile of each block prefetches rows 16 positions ahead.
    constexpr int TG = 16 / C;  // 4 heads at D=64, 2 at D=128: 16 accumulators
    alignas(64) float acc_mem[kMaxHeads * D];  // the tiles' accumulators between blocks
    for (int i = 0; i < H * D; ++i) acc_mem[i] = 0.f;
    for (int j = 0; j < num_blocks; ++j) {
        const int p0 = j * block_size, m = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int h = 0; h < num_kv_heads; ++h) {
            const KV* vb = v_cache + size_t(table[j]) * block_size * row + h * W;
            for (int g0 = h * G; g0 < (h + 1) * G; g0 += TG) {
                const int n = (h + 1) * G - g0 < TG ? (h + 1) * G - g0 : TG;
                __m512 acc[TG][C];
                for (int t = 0; t < TG; ++t)
                    for (int c = 0; c < C; ++c) acc[t][c] = t < n ? _mm512_load_ps(acc_mem + (g0 + t) * D + 16 * c) : _mm512_setzero_ps();
                for (int i = 0; i < m; ++i) {
                    const int p = p0 + i;
                    if (g0 == 0 && p + 16 < seq_len) seq.prefetch(v_cache, p + 16);
                    __m512 vv[C];
                    for (int c = 0; c < C; ++c) vv[c] = load16(vb + i * row + 16 * c);
                    const float vs = CacheRow<KV>::scale(vb + i * row, D);  // 1 for a plain cache
                    for (int t = 0; t < TG; ++t) {
                        if (t >= n) break;
                        const __m512 w = _mm512_set1_ps(s[size_t(g0 + t) * padded + p] * vs);
                        for (int c = 0; c < C; ++c) acc[t][c] = _mm512_fmadd_ps(w, vv[c], acc[t][c]);
                    }
                }
                for (int t = 0; t < n; ++t)
                    for (int c = 0; c < C; ++c) _mm512_store_ps(acc_mem + (g0 + t) * D + 16 * c, acc[t][c]);
            }
        }
    }
    store_heads<D>(acc_mem, inv, H, out, part);
}

#if defined(__AVX512BF16__)
// A bf16 cache in the pair layout (attention.py, cpu_ops.cpp's write_kv_pairs): within a block of bs
// positions, kv head h's K is [D/2][bs][2] and its V [bs/2][D][2]. One vector of K holds dimensions 2i,
// 2i+1 of 16 positions, so a query head's 16 scores are D/2 `vdpbf16ps` against its broadcast pairs
// with no reduction (over rows, with the K/V in cache, a third of the kernel's time). One vector of V holds 16
// dimensions of positions 2j, 2j+1: a shift and a mask widen both, exactly, for float32 FMAs with the
// float32 probabilities. Rounding P to bf16 for `vdpbf16ps` instead, as the prompt kernel does, was
// ~10% faster with the K/V in cache and no faster from memory, and it moved greedy tokens away from
// the row kernel's.
inline size_t pair_k(int i, int r, int bs) { return (size_t(i) * bs + r) * 2; }  // dims 2i, 2i+1 of position r
inline size_t pair_v(int r, int d, int D) { return (size_t(r / 2) * D + d) * 2 + (r & 1); }

// NT query heads' scores for 16 positions: k points at their first K pair, pairs bs * 2 elements apart.
template <int D, int NT>
inline void qk_pairs(const uint16_t* k, int bs, const uint32_t* qg, float* s, size_t padded, __m512 scale) {
    constexpr int A = 4;  // accumulators a head: the dot product's latency
    __m512 a[NT][A];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
        for (int u = 0; u < A; ++u) a[t][u] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < D / 2; i += A) {
        __m512bh kv[A];
        for (int u = 0; u < A; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(k + pair_k(i + u, 0, bs));
        for (int t = 0; t < NT; ++t)
            for (int u = 0; u < A; ++u)
                a[t][u] = _mm512_dpbf16_ps(a[t][u], (__m512bh)_mm512_set1_epi32(qg[t * (D / 2) + i + u]), kv[u]);
    }
    for (int t = 0; t < NT; ++t) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3]));
        _mm512_storeu_ps(s + t * padded, _mm512_mul_ps(sum, scale));
    }
}

// acc[NT][D] += P.V over `pairs` position pairs of one kv head's block; pg[t] the heads' probabilities
// (pstride apart), from the block's first position. A V vector's two positions come apart by a shift
// (the even one) and a mask (the odd one), each value exact in float32, so the sums are the row
// kernel's, in its order. odd: the last pair's second position is past the sequence, its V unwritten.
template <int D, int NT>
inline void pv_pairs(const uint16_t* v, int pairs, bool odd, const float* pg, size_t pstride, float* acc) {
    constexpr int C = D / 16;
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    __m512 a[NT][C];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < C; ++c) a[t][c] = _mm512_load_ps(acc + t * D + 16 * c);
    for (int j = 0; j < pairs; ++j) {
        const __mmask32 keep = odd && j == pairs - 1 ? 0x55555555u : 0xffffffffu;  // 0 * an unwritten inf is nan
        __m512 v0[C], v1[C];
        for (int c = 0; c < C; ++c) {
            const __m512i vv = _mm512_maskz_loadu_epi16(keep, v + pair_v(2 * j, 16 * c, D));
            v0[c] = _mm512_castsi512_ps(_mm512_slli_epi32(vv, 16));
            v1[c] = _mm512_castsi512_ps(_mm512_and_si512(vv, high));
        }
        for (int t = 0; t < NT; ++t) {
            const __m512 w0 = _mm512_set1_ps(pg[t * pstride + 2 * j]), w1 = _mm512_set1_ps(pg[t * pstride + 2 * j + 1]);
            for (int c = 0; c < C; ++c) a[t][c] = _mm512_fmadd_ps(w1, v1[c], _mm512_fmadd_ps(w0, v0[c], a[t][c]));
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc + t * D + 16 * c, a[t][c]);
}

// attend_seq over a pair-layout cache: the same passes, arguments and `part` output.
template <int D>
void attend_pairs(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,
                  int seq_len, uint16_t* out, int num_kv_heads, int G, int bs, float scale,
                  std::vector<float>& scores, int skip, float softcap, float* part) {
    const int H = num_kv_heads * G;
    const size_t head_block = size_t(bs) * D, block = num_kv_heads * head_block;  // elements
    const int padded = (seq_len + 31) & ~31;  // whole position pairs of whole vectors
    scores.resize(size_t(H) * padded + size_t(H) * D + 16);
    float* s = scores.data();  // [H][padded]: the scores, then the probabilities (zeros past the end)
    const uintptr_t acc_at = reinterpret_cast<uintptr_t>(s + size_t(H) * padded);
    float* acc = reinterpret_cast<float*>((acc_at + 63) & ~uintptr_t(63));  // [H][D], aligned
    alignas(64) uint32_t qp[kMaxHeads * D / 2];
    std::memcpy(qp, q, sizeof(uint16_t) * H * D);
    const __m512 vscale = _mm512_set1_ps(scale);
    const int num_blocks = (seq_len + bs - 1) / bs;
    auto tile = [&](int n, auto body) {  // up to 4 query heads at a time, as a template count
        switch (n) {
            case 1: body(std::integral_constant<int, 1>{}); break;
            case 2: body(std::integral_constant<int, 2>{}); break;
            case 3: body(std::integral_constant<int, 3>{}); break;
            default: body(std::integral_constant<int, 4>{});
        }
    };
    for (int j = 0; j < num_blocks; ++j) {
        const uint16_t* blk = k_cache + size_t(table[j]) * block;
        const uint16_t* next = j + 1 < num_blocks ? k_cache + size_t(table[j + 1]) * block  // then V's first
                                                  : v_cache + size_t(table[0]) * block;
        for (int h = 0; h < num_kv_heads; ++h) {
            prefetch_l2(next + h * head_block, head_block * 2);
            for (int p = j * bs; p < (j + 1) * bs && p < seq_len; p += 16)
                for (int g0 = h * G; g0 < (h + 1) * G; g0 += 4)
                    tile(std::min(4, (h + 1) * G - g0), [&](auto nt) {
                        const uint16_t* k = blk + h * head_block + pair_k(0, p - j * bs, bs);
                        qk_pairs<D, decltype(nt)::value>(k, bs, qp + g0 * (D / 2), s + size_t(g0) * padded + p, padded,
                                                         vscale);
                    });
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < H; ++g) cap_and_mask(s + size_t(g) * padded, seq_len, skip, softcap);
    float inv[kMaxHeads];
    softmax_heads<D>(s, H, padded, seq_len, inv, part);  // zeros past the end: a pair's second may be past it
    constexpr int TG = 16 / (D / 16);  // query heads a tile: 16 accumulators
    std::fill(acc, acc + size_t(H) * D, 0.f);
    for (int j = 0; j < num_blocks; ++j) {
        const uint16_t* blk = v_cache + size_t(table[j]) * block;
        const int m = std::min(bs, seq_len - j * bs);
        for (int h = 0; h < num_kv_heads; ++h) {
            if (j + 1 < num_blocks)
                prefetch_l2(v_cache + size_t(table[j + 1]) * block + h * head_block, head_block * 2);
            for (int g0 = h * G; g0 < (h + 1) * G; g0 += TG)
                tile(std::min(TG, (h + 1) * G - g0), [&](auto nt) {
                    constexpr int NT = std::min(int(decltype(nt)::value), TG);
                    pv_pairs<D, NT>(blk + h * head_block, (m + 1) / 2, m & 1, s + size_t(g0) * padded + j * bs,
                                    padded, acc + size_t(g0) * D);
                });
        }
    }
    store_heads<D>(acc, inv, H, out, part);
}
#endif
#elif defined(ITERSERVE_SIMD_DECODE)
// The same computation with AVX2 (8 lanes) for head_dim 64 and 128: 8 positions scored per vector.
// Without bf16 dot products, a bf16 (or int8) cache's K vectors are widened in registers, once for
// up to 3 query heads of their kv head (qk_rows4).

// a[0..7] -> one vector of their 8 horizontal sums, in order.
inline __m256 reduce8(const __m256* a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Q.K of NT query heads (of one kv head) over 4 positions' K rows, 8 dimensions a step: the heads'
// query vectors and the 4 x NT sums stay in registers (12 + 3 + 1 of the 16 at NT = 3), so each K
// vector is loaded and widened once for all NT heads, straight from the cache, and each query vector
// once per 4 rows. Sums per row in dimension order, as one row at a time would give.
template <int D, int NT, typename KV>
inline void qk_rows4(const float* qs, const KV* const* k, __m256 (*partial)[8], int r0) {
    __m256 acc[NT][4];
    for (int c = 0; c < D / 8; ++c) {
        __m256 qv[NT];
        for (int t = 0; t < NT; ++t) qv[t] = _mm256_load_ps(qs + t * D + 8 * c);
        for (int r = 0; r < 4; ++r) {
            const __m256 kv = load8(k[r] + 8 * c);
            for (int t = 0; t < NT; ++t)
                acc[t][r] = c == 0 ? _mm256_mul_ps(qv[t], kv) : _mm256_fmadd_ps(qv[t], kv, acc[t][r]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int r = 0; r < 4; ++r) partial[t][r0 + r] = acc[t][r];
}

// acc[t][0 .. 32) += P.V for NT query heads of one kv head over m positions of a block: dimensions
// c0 .. c0 + 31 of each V row (v, rows `row` apart) widened once for all NT heads, 12 accumulators, 3 broadcast
// probabilities and 1 V vector in the 16 registers. p[t * pstride + i]: head t's probability of the
// block's position i. `ahead` (one tile per block) prefetches V 16 positions on from p0.
template <int D, int NT, typename KV>
inline void pv_rows(const KV* v, int c0, size_t row, int m, const float* p, size_t pstride, float* acc_mem,
                    const SeqRows<KV>* ahead, int p0) {
    __m256 acc[NT][4];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < 4; ++c) acc[t][c] = _mm256_load_ps(acc_mem + t * D + 8 * c);
    for (int i = 0; i < m; ++i, v += row) {
        if (ahead && p0 + i + 16 < ahead->seq_len) ahead->prefetch(ahead->v_cache, p0 + i + 16);
        const float vs = CacheRow<KV>::scale(v, D);  // 1 for a plain cache
        __m256 w[NT];
        for (int t = 0; t < NT; ++t) w[t] = _mm256_set1_ps(p[t * pstride + i] * vs);
        for (int c = 0; c < 4; ++c) {
            const __m256 x = load8(v + c0 + 8 * c);
            for (int t = 0; t < NT; ++t) acc[t][c] = _mm256_fmadd_ps(w[t], x, acc[t][c]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < 4; ++c) _mm256_store_ps(acc_mem + t * D + 8 * c, acc[t][c]);
}

// See the AVX-512 attend_seq: the same passes, the same `part` output for a slice of a split context.
template <int D, typename T, typename KV>
void attend_seq(const T* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int seq_len, T* out,
                int num_kv_heads, int G, int block_size, float scale, std::vector<float>& scores, int skip,
                float softcap, float* part = nullptr) {
    constexpr int W = D + CacheRow<KV>::extra;
    const int H = num_kv_heads * G;
    const size_t row = size_t(num_kv_heads) * W;
    alignas(32) float qs[kMaxHeads * D];  // the queries, scaled, in float32
    for (int i = 0; i < H * D; ++i) qs[i] = to_f32(q[i]) * scale;
    const int padded = (seq_len + 7) & ~7;
    scores.resize(size_t(H) * padded);
    float* s = scores.data();
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    const SeqRows<KV> seq{k_cache, v_cache, table, seq_len, block_size, row};
    seq.start();
    const KV* rows[8];
    __m256 partial[3][8];
    for (int p0 = 0; p0 < seq_len; p0 += 8) {  // 8 positions at a time, one score per lane
        seq.template fetch<8>(rows, p0);
        for (int h = 0; h < num_kv_heads; ++h) {
            const KV* k[8];
            alignas(32) float ks[8];
            for (int r = 0; r < 8; ++r) {
                k[r] = rows[r] + h * W;
                ks[r] = CacheRow<KV>::scale(k[r], D);
            }
            const __m256 row_scale = _mm256_load_ps(ks);
            for (int g0 = h * G; g0 < (h + 1) * G; g0 += 3) {
                const int n = (h + 1) * G - g0 < 3 ? (h + 1) * G - g0 : 3;
                for (int r0 = 0; r0 < 8; r0 += 4) {
                    if (n == 3) qk_rows4<D, 3>(qs + g0 * D, k + r0, partial, r0);
                    else if (n == 2) qk_rows4<D, 2>(qs + g0 * D, k + r0, partial, r0);
                    else qk_rows4<D, 1>(qs + g0 * D, k + r0, partial, r0);
                }
                for (int t = 0; t < n; ++t)
                    _mm256_storeu_ps(s + size_t(g0 + t) * padded + p0, _mm256_mul_ps(reduce8(partial[t]), row_scale));
            }
        }
    }
    if (skip > 0 || softcap > 0.f)
        for (int g = 0; g < H; ++g) cap_and_mask(s + size_t(g) * padded, seq_len, skip, softcap);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float inv[kMaxHeads];
    for (int g = 0; g < H; ++g) {
        float* sg = s + size_t(g) * padded;
        __m256 top = _mm256_set1_ps(-INFINITY);  // gcc leaves a scalar max loop serial
        for (int p = 0; p < seq_len; p += 8) {  // (x, top): a NaN score is passed over, as the scalar compare does
            const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seq_len - p), lane));
            top = _mm256_max_ps(_mm256_blendv_ps(top, _mm256_loadu_ps(sg + p), valid), top);
        }
        const float max_score = hmax8(top);
        const __m256 mx = _mm256_set1_ps(max_score);
        __m256 sum = _mm256_setzero_ps();
        for (int p = 0; p < seq_len; p += 8) {  // lanes past seq_len are zeroed: padding, not positions
            const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seq_len - p), lane));
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + p), mx)), valid);
            _mm256_storeu_ps(sg + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        const float total = hsum8(sum);
        inv[g] = 1.f / total;
        if (part) {
            part[size_t(H) * D + 2 * g] = max_score;
            part[size_t(H) * D + 2 * g + 1] = total;
        }
    }
    // P.V block by block, as AVX-512 does, in column strips of 32 (pv_rows).
    alignas(32) float acc_mem[kMaxHeads * D];
    for (int i = 0; i < H * D; ++i) acc_mem[i] = 0.f;
    for (int j = 0; j < num_blocks; ++j) {
        const int p0 = j * block_size, m = seq_len - p0 < block_size ? seq_len - p0 : block_size;
        for (int h = 0; h < num_kv_heads; ++h) {
            const KV* vb = v_cache + size_t(table[j]) * block_size * row + h * W;
            for (int c0 = 0; c0 < D; c0 += 32)
                for (int g0 = h * G; g0 < (h + 1) * G; g0 += 3) {
                    const int n = (h + 1) * G - g0 < 3 ? (h + 1) * G - g0 : 3;
                    const SeqRows<KV>* ahead = h == 0 && c0 == 0 && g0 == 0 ? &seq : nullptr;
                    const float* sg = s + size_t(g0) * padded + p0;
                    float* acc = acc_mem + g0 * D + c0;
                    if (n == 3) pv_rows<D, 3>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                    else if (n == 2) pv_rows<D, 2>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                    else pv_rows<D, 1>(vb, c0, row, m, sg, padded, acc, ahead, p0);
                }
        }
    }
    for (int g = 0; g < H; ++g)
        for (int d = 0; d < D; ++d) {
            const float o = acc_mem[g * D + d] * inv[g];
            if (part) part[g * D + d] = o;
            else from_f32(o, out + g * D + d);
        }
}
#endif


#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Causal attention of one prompt (or chunk) in bf16: T queries at positions S-T .. S-1 over keys
// 0 .. S-1, flash-style (online softmax over steps of up to 64 keys, nothing T x S materialized).
// torch's CPU flash kernel computes every key block even where the causal mask zeroes it; this one
// stops at each query tile's last key. Q.K runs on bf16 pair dot products over 16-key blocks laid out
// pair-interleaved (kt), softmax in float32, P.V on bf16 pair dot products too: probabilities
// rounded to bf16 (as GPU flash attention does), float32 sums. A step of 4 blocks rather than 1 shares
// each broadcast query pair among 4 blocks' dot products and the softmax's reductions, exp and
// rescaling among 64 keys: 1.38x (512 tokens) and 1.44x (2,048) one block a step's time (Zen 4,
// attention_ab.py, docs/performance.md 2026-12-02).
constexpr int kTile = 16;  // queries per work item, keys per block
constexpr int kStep = 4;   // blocks per online-softmax step

// The keys of a 16-key block a query sees: the first `valid` (at or before its position), less the
// first `behind` (before its window).
inline __mmask16 live_keys(int valid, int behind) {
    if (valid <= 0 || behind >= kTile) return 0;
    __mmask16 live = valid >= kTile ? __mmask16(0xffff) : __mmask16((1u << valid) - 1u);
    return behind > 0 ? __mmask16(live & ~((1u << behind) - 1u)) : live;
}

template <int D>
struct PromptScratch {
    std::vector<uint32_t> kt;  // [Hkv][blocks][D/2][16]: key j's bf16 pair (2d, 2d+1) at [d][j]
    std::vector<uint32_t> vp;  // [Hkv][blocks][8][D]: keys 2j and 2j+1's bf16 values of dim d at [j][d]
};

template <int D>
void prompt_tile(const uint16_t* q, int64_t q_stride, uint16_t* out, int T, int S, int H, int G, int h, int tile,
                 float scale, int window, const uint32_t* kt, const uint32_t* vp, std::vector<float>& acc_buf) {
    constexpr int C = D / 16, P = D / 2;
    const int rows = T - tile * kTile < kTile ? T - tile * kTile : kTile, nq = rows * G;
    acc_buf.assign(size_t(nq) * (D + 2), 0.f);
    float* acc = acc_buf.data();        // [nq][D]
    float* m = acc + size_t(nq) * D;     // running max per query vector
    float* l = m + nq;                   // running sum
    for (int i = 0; i < nq; ++i) m[i] = -INFINITY;
    const int first_pos = S - T + tile * kTile;  // absolute position of the tile's first query
    const int num_blocks = (first_pos + rows - 1) / kTile + 1;
    // A windowed layer starts at the step holding the first query's first visible key. Steps start at
    // block numbers that are multiples of kStep for every tile, so a query's sums never depend on its tile.
    const int first_block = (window > 0 ? std::max(0, first_pos - window + 1) / kTile : 0) / kStep * kStep;
    alignas(64) uint32_t pairs[4][8 * kStep];  // this step's probabilities in bf16, two keys per word
    // Up to kStep blocks of 16 keys a step (NB: fewer at the tile's last step, whose further blocks
    // would be past every query of the tile).
    auto step = [&](int b, auto nb) {
        constexpr int NB = decltype(nb)::value;
        const uint32_t* kb = kt + size_t(b) * P * 16;
        const uint32_t* vb = vp + size_t(b) * 8 * D;
        for (int i0 = 0; i0 < nq; i0 += 4) {  // 4 query vectors share each K load
            const int n = nq - i0 < 4 ? nq - i0 : 4;
            const uint32_t* qp[4];
            for (int t = 0; t < 4; ++t) {
                const int i = i0 + (t < n ? t : 0), r = i / G, g = i % G;
                qp[t] = reinterpret_cast<const uint32_t*>(q + (tile * kTile + r) * q_stride + (h * G + g) * D);
            }
            // Each broadcast query pair meets every block's keys: 4 x NB independent chains of dot
            // products, one broadcast per NB of them.
            __m512 sc[4][NB];
            for (int t = 0; t < 4; ++t)
                for (int e = 0; e < NB; ++e) sc[t][e] = _mm512_setzero_ps();
            for (int d = 0; d < P; ++d) {
                __m512bh kk[NB];
                for (int e = 0; e < NB; ++e) kk[e] = (__m512bh)_mm512_loadu_si512(kb + (e * P + d) * 16);
                for (int t = 0; t < 4; ++t) {
                    const __m512bh qq = (__m512bh)_mm512_set1_epi32(int(qp[t][d]));
                    for (int e = 0; e < NB; ++e) sc[t][e] = _mm512_dpbf16_ps(sc[t][e], qq, kk[e]);
                }
            }
            for (int t = 0; t < n; ++t) {
                const int i = i0 + t, pos = first_pos + i / G;
                const int valid = pos - b * kTile + 1;  // keys of block b at or before pos (of b + e: 16 e fewer)
                const int behind = window > 0 ? pos - window + 1 - b * kTile : 0;  // keys before the window
                __mmask16 live[NB];
                bool any = false;
                for (int e = 0; e < NB; ++e) any |= (live[e] = live_keys(valid - e * kTile, behind - e * kTile)) != 0;
                if (!any) {
                    for (int j = 0; j < 8 * NB; ++j) pairs[t][j] = 0;
                    continue;
                }
                const __m512 scl = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
                __m512 x[NB], top = ninf, sum = _mm512_setzero_ps();
                for (int e = 0; e < NB; ++e) top = _mm512_max_ps(top, x[e] = _mm512_mask_mul_ps(ninf, live[e], sc[t][e], scl));
                const float m_new = std::max(m[i], _mm512_reduce_max_ps(top));
                const float corr = std::exp(m[i] - m_new);  // 0 on the first step (m = -inf)
                const __m512 mx = _mm512_set1_ps(m_new);
                for (int e = 0; e < NB; ++e) {
                    const __m512 pr = _mm512_maskz_mov_ps(live[e], exp16(_mm512_sub_ps(x[e], mx)));
                    sum = _mm512_add_ps(sum, pr);
                    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[t] + 8 * e), (__m256i)_mm512_cvtneps_pbh(pr));
                }
                l[i] = l[i] * corr + _mm512_reduce_add_ps(sum);
                m[i] = m_new;
                if (corr != 1.f)
                    for (int c = 0; c < C; ++c)
                        _mm512_storeu_ps(acc + size_t(i) * D + 16 * c,
                                         _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * D + 16 * c), _mm512_set1_ps(corr)));
            }
            __m512 a[4][C];
            for (int t = 0; t < n; ++t)
                for (int c = 0; c < C; ++c) a[t][c] = _mm512_loadu_ps(acc + size_t(i0 + t) * D + 16 * c);
            for (int j = 0; j < 8 * NB; ++j) {  // key pairs, block by block
                __m512bh vv[C];
                for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + j * D + 16 * c);
                for (int t = 0; t < 4; ++t) {
                    if (t >= n) break;
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pairs[t][j]));
                    for (int c = 0; c < C; ++c) a[t][c] = _mm512_dpbf16_ps(a[t][c], w, vv[c]);
                }
            }
            for (int t = 0; t < n; ++t)
                for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + size_t(i0 + t) * D + 16 * c, a[t][c]);
        }
    };
    static_assert(kStep == 4);
    for (int b = first_block; b < num_blocks; b += kStep) {
        switch (std::min(num_blocks - b, kStep)) {
            case 1: step(b, std::integral_constant<int, 1>{}); break;
            case 2: step(b, std::integral_constant<int, 2>{}); break;
            case 3: step(b, std::integral_constant<int, 3>{}); break;
            default: step(b, std::integral_constant<int, 4>{});
        }
    }
    for (int i = 0; i < nq; ++i) {
        const int r = i / G, g = i % G;
        uint16_t* o = out + (size_t(tile * kTile + r) * H + h * G + g) * D;
        for (int d = 0; d < D; ++d) from_f32(acc[size_t(i) * D + d] / l[i], o + d);
    }
}

template <int D>
void prompt_attention(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
                      int64_t v_stride, uint16_t* out, int T, int S, int H, int Hkv, float scale, int num_threads,
                      int window) {
    constexpr int P = D / 2;
    const int G = H / Hkv, nkb = (S + kTile - 1) / kTile, ntiles = (T + kTile - 1) / kTile;
    static thread_local PromptScratch<D> scratch;  // reused across layers and steps
    scratch.kt.resize(size_t(Hkv) * nkb * P * 16);
    scratch.vp.resize(size_t(Hkv) * nkb * 8 * D);
    uint32_t* kt = scratch.kt.data();
    uint32_t* vp = scratch.vp.data();
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < Hkv * nkb; ++item) {  // lay K and V blocks out for the tiles
            const int h = item / nkb, b = item % nkb;
            uint32_t* kd = kt + size_t(item) * P * 16;
            uint32_t* vd = vp + size_t(item) * 8 * D;
            for (int j = 0; j < 16; ++j) {
                const int pos = b * kTile + j;
                const uint16_t* kr = k + pos * k_stride + h * D;
                for (int d = 0; d < P; ++d)
                    kd[d * 16 + j] = pos < S ? uint32_t(kr[2 * d]) | uint32_t(kr[2 * d + 1]) << 16 : 0u;
            }
            for (int j = 0; j < 8; ++j) {
                const int p0 = b * kTile + 2 * j;
                const uint16_t* v0 = v + p0 * v_stride + h * D;
                const uint16_t* v1 = v0 + v_stride;
                for (int d = 0; d < D; ++d)
                    vd[j * D + d] = (p0 < S ? uint32_t(v0[d]) : 0u) | (p0 + 1 < S ? uint32_t(v1[d]) << 16 : 0u);
            }
        }
        std::vector<float> acc_buf;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < Hkv * ntiles; ++item) {  // the longest (last) tiles first
            const int tile = ntiles - 1 - item / Hkv, h = item % Hkv;
            prompt_tile<D>(q, q_stride, out, T, S, H, G, h, tile, scale, window, kt + size_t(h) * nkb * P * 16,
                           vp + size_t(h) * nkb * 8 * D, acc_buf);
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ITERSERVE_PROMPT_F32 1
// The same causal attention in float32 on AVX2 (--dtype float32, and bf16 storage, whose queries are
// float32 and whose K/V the cache's, widened): the flash structure above on 8 lanes, without bf16
// dot products. Both products are the classic AVX2 register tile of 6 rows by 16 columns (12
// accumulators, 2 vector loads and 6 broadcasts a step): Q.K against keys laid out transposed in
// blocks of 16 ([D][16]), P.V against V rows; the online softmax runs a step of 64 keys at a time,
// and a tile of queries stops at its last query's key where torch's flash kernel computes every key
// block. Only where it was measured against torch's kernel (AVX2 CPUs, docs/performance.md): an
// AVX-512 build keeps torch's.
constexpr int kKeyBlock = 16;   // keys per laid-out block of K
constexpr int kStepKeys = 64;   // keys per online-softmax step
constexpr int kQueryRows = 16;  // query positions per work item
constexpr int kRegRows = 6;     // query vectors per register tile

// c[t][0 .. 16) = (Accumulate: c[t] +) sum over i < n of a[t][i] * b[i][0 .. 16), t < 6: Q.K against a
// block of keys laid out [D][16] (a: the queries), and P.V against 16 columns of V rows (a: the
// probabilities). b rows b_stride apart, c rows c_stride apart.
template <bool Accumulate>
inline void tile_6x16(const float* const* a, const float* b, int64_t b_stride, int n, float* c, int64_t c_stride) {
    __m256 acc[kRegRows][2];
    for (int t = 0; t < kRegRows; ++t)
        for (int h = 0; h < 2; ++h)
            acc[t][h] = Accumulate ? _mm256_loadu_ps(c + t * c_stride + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
        const __m256 b0 = _mm256_loadu_ps(b + i * b_stride), b1 = _mm256_loadu_ps(b + i * b_stride + 8);
        for (int t = 0; t < kRegRows; ++t) {
            const __m256 x = _mm256_broadcast_ss(a[t] + i);
            acc[t][0] = _mm256_fmadd_ps(x, b0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(x, b1, acc[t][1]);
        }
    }
    for (int t = 0; t < kRegRows; ++t)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + t * c_stride + 8 * h, acc[t][h]);
}

// Turns query i's scores s[0 .. n) of a step starting at key k0 into probabilities in place (0 outside
// [lo, hi): after its position, or before its window), carrying its running max m, sum l and acc row.
template <int D>
inline void softmax_step(float* s, int n, int lo, int hi, float scale, float& m, float& l, float* acc) {
    if (hi <= lo) {  // no key of this step is visible to the query
        std::fill(s, s + n, 0.f);
        return;
    }
    const __m256 scl = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 top = ninf;
    for (int j = 0; j < n; j += 8) {  // scaled scores, -inf where masked, and their max
        const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
        const __m256 live = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hi), key),
                                                                 _mm256_cmpgt_epi32(key, _mm256_set1_epi32(lo - 1))));
        const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(s + j), scl), live);
        top = _mm256_max_ps(top, x);
        _mm256_storeu_ps(s + j, x);
    }
    const float m_new = std::max(m, hmax8(top));
    const float corr = std::exp(m - m_new);  // 0 on the first step (m = -inf)
    const __m256 mx = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        const __m256 pr = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp8(_mm256_sub_ps(x, mx)));
        sum = _mm256_add_ps(sum, pr);
        _mm256_storeu_ps(s + j, pr);
    }
    l = l * corr + hsum8(sum);
    m = m_new;
    if (corr != 1.f)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), _mm256_set1_ps(corr)));
}

// One work item: query rows tile * 16 .. of kv head h's G query heads. kt: the head's K blocks, vp its
// V rows (zero past S, up to whole blocks).
template <int D>
void prompt_tile_f32(const float* q, int64_t q_stride, float* out, int T, int S, int H, int G, int h, int tile,
                     float scale, int window, const float* kt, const float* vp, std::vector<float>& buf) {
    const int rows = std::min(kQueryRows, T - tile * kQueryRows), nq = rows * G;
    const int np = (nq + kRegRows - 1) / kRegRows * kRegRows;  // whole register tiles: the last padded
    buf.assign(size_t(np) * (D + kStepKeys) + 2 * size_t(np), 0.f);
    float* acc = buf.data();                   // [np][D]
    float* s = acc + size_t(np) * D;           // [np][kStepKeys]: a step's scores, then probabilities
    float* m = s + size_t(np) * kStepKeys;     // running max per query vector
    float* l = m + np;                         // running sum
    std::fill(m, m + np, -INFINITY);
    std::vector<const float*> qp(size_t(np), nullptr);
    for (int i = 0; i < np; ++i) {  // padding rows repeat the last query: finite sums, never stored
        const int r = std::min(i, nq - 1) / G, g = std::min(i, nq - 1) % G;
        qp[i] = q + (tile * kQueryRows + r) * q_stride + (h * G + g) * D;
    }
    const int first_pos = S - T + tile * kQueryRows, end = first_pos + rows;  // the tile sees keys 0 .. end - 1
    // Steps start at fixed multiples of kStepKeys, so a query's sums never depend on its tile or chunk.
    const int start = (window > 0 ? std::max(0, first_pos - window + 1) : 0) / kStepKeys * kStepKeys;
    for (int k0 = start; k0 < end; k0 += kStepKeys) {
        const int n = (std::min(kStepKeys, end - k0) + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        for (int i0 = 0; i0 < np; i0 += kRegRows)
            for (int b = 0; b < n; b += kKeyBlock)
                tile_6x16<false>(qp.data() + i0, kt + size_t(k0 + b) * D, kKeyBlock, D, s + size_t(i0) * kStepKeys + b,
                                 kStepKeys);
        for (int i = 0; i < np; ++i) {
            const int pos = first_pos + std::min(i, nq - 1) / G;
            const int lo = window > 0 ? std::max(0, pos - window + 1 - k0) : 0, hi = std::min(n, pos - k0 + 1);
            softmax_step<D>(s + size_t(i) * kStepKeys, n, lo, hi, scale, m[i], l[i], acc + size_t(i) * D);
        }
        for (int i0 = 0; i0 < np; i0 += kRegRows) {
            const float* pr[kRegRows];
            for (int t = 0; t < kRegRows; ++t) pr[t] = s + size_t(i0 + t) * kStepKeys;
            for (int c = 0; c < D; c += 16)
                tile_6x16<true>(pr, vp + size_t(k0) * D + c, D, n, acc + size_t(i0) * D + c, D);
        }
    }
    for (int i = 0; i < nq; ++i) {
        const int r = i / G, g = i % G;
        float* o = out + (size_t(tile * kQueryRows + r) * H + h * G + g) * D;
        const __m256 inv = _mm256_set1_ps(1.f / l[i]);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + size_t(i) * D + d), inv));
    }
}

template <int D>
void prompt_attention_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                          int64_t v_stride, float* out, int T, int S, int H, int Hkv, float scale, int num_threads,
                          int window) {
    const int G = H / Hkv, nkb = (S + kKeyBlock - 1) / kKeyBlock, ntiles = (T + kQueryRows - 1) / kQueryRows;
    static thread_local std::vector<float> kt_buf, vp_buf;  // reused across layers and steps
    kt_buf.resize(size_t(Hkv) * nkb * kKeyBlock * D);
    vp_buf.resize(size_t(Hkv) * nkb * kKeyBlock * D);
    float* kt = kt_buf.data();  // [Hkv][blocks][D][16]: key j of a block, dim d at [d][j]
    float* vp = vp_buf.data();  // [Hkv][blocks * 16][D]: V rows, zero past S
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < Hkv * nkb; ++item) {  // lay K and V blocks out for the tiles
            const int h = item / nkb, b = item % nkb;
            float* kd = kt + size_t(item) * kKeyBlock * D;
            float* vd = vp + size_t(item) * kKeyBlock * D;
            for (int j = 0; j < kKeyBlock; ++j) {
                const int pos = b * kKeyBlock + j;
                const float* kr = k + pos * k_stride + h * D;
                const float* vr = v + pos * v_stride + h * D;
                for (int d = 0; d < D; ++d) {
                    kd[d * kKeyBlock + j] = pos < S ? kr[d] : 0.f;
                    vd[j * D + d] = pos < S ? vr[d] : 0.f;
                }
            }
        }
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < Hkv * ntiles; ++item) {  // the longest (last) tiles first
            const int tile = ntiles - 1 - item / Hkv, h = item % Hkv;
            prompt_tile_f32<D>(q, q_stride, out, T, S, H, G, h, tile, scale, window,
                               kt + size_t(h) * nkb * kKeyBlock * D, vp + size_t(h) * nkb * kKeyBlock * D, buf);
        }
    }
}
#endif

#if defined(ITERSERVE_SIMD_DECODE)
// A split context's slices merged, per head: each slice's output weighted by its exp-sum rescaled
// to the common max (the flash-decoding reduction).
template <int D, typename T>
void merge_slices(const float* parts, int num_parts, int H, T* out) {
    const size_t stride = size_t(H) * (D + 2);
    for (int g = 0; g < H; ++g) {
        float top = -INFINITY;
        for (int i = 0; i < num_parts; ++i) top = std::max(top, parts[i * stride + size_t(H) * D + 2 * g]);
        float w[kMaxSlices], total = 0.f;
        for (int i = 0; i < num_parts; ++i) {
            const float* ml = parts + i * stride + size_t(H) * D + 2 * g;
            w[i] = ml[1] * std::exp(ml[0] - top);
            total += w[i];
        }
        for (int d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int i = 0; i < num_parts; ++i) acc += w[i] * parts[i * stride + g * D + d];
            from_f32(acc / total, out + g * D + d);
        }
    }
}
// Work items are slices of kSlice positions (whole blocks; fewer, longer ones past kMaxSlices), attended
// apart and merged: a single long chat keeps every thread busy. Where a context is cut depends on its
// length alone, never on the batch or the threads, so a row's sums are its own: a speculative verify
// step, whose rows are one sequence's decode rows, gives the bits its one-token steps would have.
template <int D, typename T, typename KV>
void decode_simd(const T* q, int64_t q_stride, const KV* k_cache, const KV* v_cache, const int32_t* block_tables,
                   int64_t table_stride, const int32_t* seq_lens, T* out, int num_seqs, int H, int num_kv_heads, int block_size,
                   float scale, int num_threads, int window, float softcap, bool pairs) {
    struct Item { int seq, begin, len, part, skip; };  // part: index of its slice buffer, -1 when whole
    struct Split { int seq, first_part, num_parts; };
    std::vector<Item> items;
    std::vector<Split> splits;
    const int G = H / num_kv_heads;
    const int slice_blocks = (kSlice + block_size - 1) / block_size;
    int num_parts = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int lo = window > 0 ? std::max(0, seq_lens[b] - window) : 0, first = lo / block_size * block_size;
        const int len = seq_lens[b] - first;  // from the block holding the window's first position
        const int slices = std::min((len + slice_blocks * block_size - 1) / (slice_blocks * block_size), kMaxSlices);
        if (slices <= 1) {
            items.push_back({b, first, len, -1, lo - first});
            continue;
        }
        const int blocks = (len + block_size - 1) / block_size, per = (blocks + slices - 1) / slices;
        splits.push_back({b, num_parts, 0});
        for (int begin = first; begin < seq_lens[b]; begin += per * block_size)
            items.push_back({b, begin, std::min(per * block_size, seq_lens[b] - begin), num_parts++,
                             begin == first ? lo - first : 0});
        splits.back().num_parts = num_parts - splits.back().first_part;
    }
    const size_t part_size = size_t(H) * (D + 2);
    std::vector<float> parts(part_size * num_parts);
    const size_t seq_stride = size_t(H) * D;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < items.size(); ++i) {
            const Item& it = items[i];
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<KV, uint16_t>) {
                if (pairs) {
                    attend_pairs<D>(q + it.seq * q_stride, k_cache, v_cache,
                                    block_tables + it.seq * table_stride + it.begin / block_size, it.len,
                                    out + it.seq * seq_stride, num_kv_heads, G, block_size, scale, scores, it.skip,
                                    softcap, it.part < 0 ? nullptr : parts.data() + it.part * part_size);
                    continue;
                }
            }
#endif
            attend_seq<D, T, KV>(q + it.seq * q_stride, k_cache, v_cache,
                                    block_tables + it.seq * table_stride + it.begin / block_size, it.len,
                                    out + it.seq * seq_stride, num_kv_heads, G, block_size, scale, scores, it.skip,
                                    softcap, it.part < 0 ? nullptr : parts.data() + it.part * part_size);
        }
    }
    for (const Split& sp : splits)
        merge_slices<D, T>(parts.data() + sp.first_part * part_size, sp.num_parts, H, out + sp.seq * seq_stride);
}
#endif

// Whether this build reads a bf16 cache in the pair layout for these shapes.
inline bool pairs_supported(int head_dim, int block_size, int num_heads) {
#if defined(__AVX512BF16__) && defined(ITERSERVE_SIMD_DECODE)
    return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && num_heads <= kMaxHeads;
#else
    (void)head_dim, (void)block_size, (void)num_heads;
    return false;
#endif
}

template <typename T, typename KV>
int decode(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache, const int32_t* block_tables,
           int64_t table_stride, const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
           int num_kv_heads, int head_dim, int block_size, float scale, int num_threads, int window, float softcap,
           bool pairs = false) {
    const int G = num_heads / num_kv_heads;
    if (head_dim > kMaxHeadDim || G > kMaxGroup || G * num_kv_heads != num_heads) return 1;
    if (pairs && !pairs_supported(head_dim, block_size, num_heads)) return 1;  // never read pairs as rows
    const T* qt = static_cast<const T*>(q);
    const KV* kc = static_cast<const KV*>(k_cache);
    const KV* vc = static_cast<const KV*>(v_cache);
    T* ot = static_cast<T*>(out);
    const size_t seq_stride = size_t(num_heads) * head_dim;
#if defined(ITERSERVE_SIMD_DECODE)
    if ((head_dim == 64 || head_dim == 128) && num_heads <= kMaxHeads) {
        if (head_dim == 64)
            decode_simd<64, T, KV>(qt, q_stride, kc, vc, block_tables, table_stride, seq_lens, ot, num_seqs, num_heads,
                                 num_kv_heads, block_size, scale, num_threads, window, softcap, pairs);
        else
            decode_simd<128, T, KV>(qt, q_stride, kc, vc, block_tables, table_stride, seq_lens, ot, num_seqs, num_heads,
                                  num_kv_heads, block_size, scale, num_threads, window, softcap, pairs);
        return 0;
    }
#endif
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_seqs * num_kv_heads; ++item) {
            const int b = item / num_kv_heads, h = item % num_kv_heads;
            const int lo = window > 0 ? std::max(0, seq_lens[b] - window) : 0, first = lo / block_size;
            attend_one<T, KV>(qt + b * q_stride, kc, vc, block_tables + b * table_stride + first,
                          seq_lens[b] - first * block_size, ot + b * seq_stride, num_kv_heads, G, head_dim,
                          block_size, scale, h, scores, lo - first * block_size, softcap);
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// q [num_seqs, num_heads, head_dim] with sequences q_stride elements apart (heads contiguous: a view
// into the fused qkv rows needs no copy), out the same shape contiguous; k_cache, v_cache
// [num_blocks, block_size, num_kv_heads, head_dim], contiguous; block_tables [num_seqs, table_stride]
// int32; seq_lens [num_seqs] int32. window > 0: each query sees only the last `window` positions;
// softcap > 0: scores = softcap * tanh(scores / softcap). Returns 0, or 1 for shapes it does not
// handle. dtype: 0 float32, 1 bfloat16, 2 float32 q and out over a bfloat16 cache (--dtype bf16-storage),
// 3 bfloat16 with the cache in the pair layout (attend_pairs; 1 where iterserve_decode_pairs_supported is 0).
int iterserve_decode_attention(int dtype, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                               void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, float scale, int num_threads, int window, float softcap) {
    if (dtype == 0)
        return decode<float, float>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_seqs,
                                    num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, window, softcap);
    if (dtype == 3)  // bfloat16 in the pair layout
        return decode<uint16_t, uint16_t>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out,
                                          num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads,
                                          window, softcap, true);
    if (dtype == 2)
        return decode<float, uint16_t>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out,
                                       num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads,
                                       window, softcap);
    return decode<uint16_t, uint16_t>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out,
                                      num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads,
                                      window, softcap);
}

// The same over an int8 cache (--kv-cache-dtype int8): k_cache, v_cache [num_blocks, block_size,
// num_kv_heads, head_dim + 4] int8, each head's values followed by their float32 scale (kv_quant.py).
// q and out stay in the model dtype.
int iterserve_decode_attention_int8(int dtype, const void* q, int64_t q_stride, const void* k_cache,
                                    const void* v_cache, const int32_t* block_tables, int64_t table_stride,
                                    const int32_t* seq_lens, void* out, int num_seqs, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, float scale, int num_threads, int window,
                                    float softcap) {
    if (dtype == 0)
        return decode<float, int8_t>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_seqs,
                                     num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, window, softcap);
    return decode<uint16_t, int8_t>(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_seqs,
                                    num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, window, softcap);
}


// 1 when iterserve_decode_attention reads a bfloat16 cache in the pair layout (dtype 3) for these shapes.
int iterserve_decode_pairs_supported(int head_dim, int block_size, int num_heads) {
    return pairs_supported(head_dim, block_size, num_heads) ? 1 : 0;
}

// 1 when iterserve_prompt_attention runs for this dtype and head_dim in this build, else 0.
int iterserve_prompt_attention_supported(int dtype, int head_dim) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return dtype == 1 && (head_dim == 64 || head_dim == 128);
#elif defined(ITERSERVE_PROMPT_F32)
    return dtype == 0 && (head_dim == 64 || head_dim == 128);
#else
    (void)dtype, (void)head_dim;
    return 0;
#endif
}

// q [T, H, D] with rows q_stride elements apart, k/v [S, Hkv, D] rows k/v_stride apart, out [T, H, D]
// contiguous; query i sits at position S - T + i and sees keys 0 .. S - T + i (window > 0: only the
// last `window` of them). Returns 0, or 1 where unsupported (see above).
int iterserve_prompt_attention(int dtype, const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                               const void* v, int64_t v_stride, void* out, int T, int S, int num_heads, int num_kv_heads,
                               int head_dim, float scale, int num_threads, int window) {
    if (!iterserve_prompt_attention_supported(dtype, head_dim) || num_heads % num_kv_heads || T > S || T < 1)
        return 1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const auto* qb = static_cast<const uint16_t*>(q);
    const auto *kb = static_cast<const uint16_t*>(k), *vb = static_cast<const uint16_t*>(v);
    auto* ob = static_cast<uint16_t*>(out);
    if (head_dim == 64)
        prompt_attention<64>(qb, q_stride, kb, k_stride, vb, v_stride, ob, T, S, num_heads, num_kv_heads, scale, num_threads,
                             window);
    else
        prompt_attention<128>(qb, q_stride, kb, k_stride, vb, v_stride, ob, T, S, num_heads, num_kv_heads, scale, num_threads,
                              window);
#elif defined(ITERSERVE_PROMPT_F32)
    const auto* qf = static_cast<const float*>(q);
    const auto *kf = static_cast<const float*>(k), *vf = static_cast<const float*>(v);
    auto* of = static_cast<float*>(out);
    if (head_dim == 64)
        prompt_attention_f32<64>(qf, q_stride, kf, k_stride, vf, v_stride, of, T, S, num_heads, num_kv_heads, scale,
                                 num_threads, window);
    else
        prompt_attention_f32<128>(qf, q_stride, kf, k_stride, vf, v_stride, of, T, S, num_heads, num_kv_heads, scale,
                                  num_threads, window);
#endif
    return 0;
}

}
