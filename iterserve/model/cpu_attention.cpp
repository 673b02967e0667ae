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

#include "cpu_attention_decode.h"
#include "cpu_attention_decode_avx512.h"
#include "cpu_attention_decode_avx2.h"
#include "cpu_attention_prompt.h"

namespace {

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
