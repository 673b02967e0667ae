// Decode attention with AVX-512 (attend_seq), and over a bf16 cache in the pair layout (attend_pairs).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_attention_decode.h"

namespace {

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

// Positions ahead that attend_pairs prefetches (whole blocks; at least one). It prefetches into L2 a line
// of the block that far on in the stream of K's blocks then V's with each line it reads, at the same place
// in the block: prefetching a block's lines all at once, one block ahead, queued them behind each other
// and left the arithmetic waiting on memory about as long as it had worked (see
// benchmarks/decode_attention.py; docs/performance.md).
constexpr int kPairsAhead = 32;
inline void prefetch_line(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// NT query heads' scores for 16 positions: k points at their first K pair, pairs bs * 2 elements apart.
// ahead (or null): the same place kPairsAhead positions on, its lines prefetched as k's are read.
template <int D, int NT>
inline void qk_pairs(const uint16_t* k, int bs, const uint32_t* qg, float* s, size_t padded, __m512 scale,
                     const uint16_t* ahead) {
    constexpr int A = 4;  // accumulators a head: the dot product's latency
    __m512 a[NT][A];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
        for (int u = 0; u < A; ++u) a[t][u] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < D / 2; i += A) {
        __m512bh kv[A];
        for (int u = 0; u < A; ++u) {
            if (ahead) prefetch_line(ahead + pair_k(i + u, 0, bs));
            kv[u] = (__m512bh)_mm512_loadu_si512(k + pair_k(i + u, 0, bs));
        }
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
// ahead: as qk_pairs'.
template <int D, int NT>
inline void pv_pairs(const uint16_t* v, int pairs, bool odd, const float* pg, size_t pstride, float* acc,
                     const uint16_t* ahead) {
    constexpr int C = D / 16;
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    __m512 a[NT][C];
    for (int t = 0; t < NT; ++t)
        for (int c = 0; c < C; ++c) a[t][c] = _mm512_load_ps(acc + t * D + 16 * c);
    for (int j = 0; j < pairs; ++j) {
        const __mmask32 keep = odd && j == pairs - 1 ? 0x55555555u : 0xffffffffu;  // 0 * an unwritten inf is nan
        __m512 v0[C], v1[C];
        for (int c = 0; c < C; ++c) {
            if (ahead) prefetch_line(ahead + pair_v(2 * j, 16 * c, D));
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
    const int ahead = std::max(1, kPairsAhead / bs);
    auto stream = [&](int j, int h, size_t at) -> const uint16_t* {  // block j of K's then V's; null past them
        if (j >= 2 * num_blocks) return nullptr;
        return (j < num_blocks ? k_cache : v_cache) + size_t(table[j % num_blocks]) * block + h * head_block + at;
    };
    for (int j = 0; j < std::min(ahead, num_blocks); ++j)  // nothing read before them prefetched these
        for (int h = 0; h < num_kv_heads; ++h)
            for (size_t at = 0; at < head_block; at += 32) prefetch_line(stream(j, h, at));
    for (int j = 0; j < num_blocks; ++j) {
        const uint16_t* blk = k_cache + size_t(table[j]) * block;
        for (int h = 0; h < num_kv_heads; ++h)
            for (int p = j * bs; p < (j + 1) * bs && p < seq_len; p += 16)
                for (int g0 = h * G; g0 < (h + 1) * G; g0 += 4)
                    tile(std::min(4, (h + 1) * G - g0), [&](auto nt) {
                        const size_t at = pair_k(0, p - j * bs, bs);
                        qk_pairs<D, decltype(nt)::value>(blk + h * head_block + at, bs, qp + g0 * (D / 2),
                                                         s + size_t(g0) * padded + p, padded, vscale,
                                                         g0 == h * G ? stream(j + ahead, h, at) : nullptr);
                    });
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
        for (int h = 0; h < num_kv_heads; ++h)
            for (int g0 = h * G; g0 < (h + 1) * G; g0 += TG)
                tile(std::min(TG, (h + 1) * G - g0), [&](auto nt) {
                    constexpr int NT = std::min(int(decltype(nt)::value), TG);
                    pv_pairs<D, NT>(blk + h * head_block, (m + 1) / 2, m & 1, s + size_t(g0) * padded + j * bs,
                                    padded, acc + size_t(g0) * D,
                                    g0 == h * G ? stream(num_blocks + j + ahead, h, 0) : nullptr);
                });
    }
    store_heads<D>(acc, inv, H, out, part);
}
#endif
#endif

}  // namespace
