// A decode step's decoder layers in one call (see cpu_decode.py): the loop LlamaModel._layer_forward
// runs in Python, calling the same C functions of cpu_ops.cpp, cpu_linear.cpp and cpu_attention.cpp,
// here taken as function pointers, in the same order and with the same arguments. At one sequence a
// step is ~300 such calls, and each costs a few microseconds of Python and ctypes around it: ~20% of
// the step. Only the pre-norm SiLU layer is here (no q/k norm, no output norms, no experts).
// LoRA adapters (model/lora.py) are added after each linear here too, each row under its own slot.
#include <chrono>
#include <cstdint>

#include "cpu_lora.h"

namespace {

// The parts of a layer, in cpu_decode.py's PARTS order.
enum Part { kNorm, kQkv, kRope, kWriteKv, kAttention, kO, kGateUp, kSiluMul, kDown };

template <typename F> inline void timed(double* part_seconds, Part part, F run) {
    if (!part_seconds) return run();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    part_seconds[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

extern "C" {

typedef void (*RmsNormFn)(int, const void*, void*, const void*, void*, int64_t, int64_t, float);
typedef int (*LinearFn)(int, const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t, int);
typedef void (*RopeFn)(int, void*, int64_t, int64_t, int, int, const void*, const void*, const int64_t*);
typedef void (*WriteKvFn)(const void*, int64_t, const void*, int64_t, void*, void*, const int64_t*, int64_t, int64_t);
typedef void (*WriteKvInt8Fn)(int, const void*, int64_t, const void*, int64_t, void*, void*, const int64_t*, int64_t,
                              int, int);
typedef void (*WriteKvPairsFn)(const void*, int64_t, const void*, int64_t, void*, void*, const int64_t*, int64_t, int,
                               int, int);
typedef int (*AttentionFn)(int, const void*, int64_t, const void*, const void*, const int32_t*, int64_t,
                           const int32_t*, void*, int, int, int, int, int, float, int, int, float);
typedef void (*SiluMulFn)(int, const void*, void*, int64_t, int64_t);

struct DecodeLayer {  // one layer's weights: the linears' panels, the norms' weights, its rope table
    const void* attn_norm;
    const void* qkv;
    const void* qkv_bias;  // or null
    const void* o;
    const void* mlp_norm;
    const void* gate_up;
    const void* down;
    const void* cos;
    const void* sin;
    int window;
    int qkv_dtype, o_dtype, gate_up_dtype, down_dtype;  // cpu_linear.cpp's codes for the linears' panels
};

struct DecodeStep {
    RmsNormFn rms_norm;
    LinearFn linear;
    RopeFn rope;
    WriteKvFn write_kv;  // one of these four: the others are null
    WriteKvInt8Fn write_kv_int8;
    WriteKvPairsFn write_kv_pairs;  // a bfloat16 cache in the pair layout
    WriteKvFn write_kv_bf16;  // float32 rows into a bfloat16 cache (bf16 storage): strides and width in elements
    AttentionFn attention;
    SiluMulFn silu_mul;
    int dtype;         // the arithmetic's, as the kernels code it: 0 float32, 1 bfloat16
    int attention_dtype;  // cpu_attention.cpp's code for q over this cache
    int num_threads;
    int heads, kv_heads, head_dim, block_size;
    int64_t rows, hidden, intermediate;
    float eps, scale, softcap;
    char* kv_cache;  // layer i's K at kv_cache + i * layer_bytes, its V v_offset bytes on
    int64_t layer_bytes, v_offset;
    const int64_t* positions;
    const int64_t* slot_mapping;
    const int32_t* block_tables;
    int64_t table_stride;
    const int32_t* seq_lens;
    void* x;  // the residual stream [rows, hidden], updated in place
    void* delta;  // out: the last layer's MLP output [rows, hidden], not yet added to x
    void* h;  // scratch: [rows, hidden], [rows, qkv], [rows, q], [rows, 2 intermediate], [rows, intermediate]
    void* qkv;
    void* attn;
    void* gate_up;
    void* act;
    double* part_seconds;  // or null: the seconds each Part took, added up (benchmarks/step_time.py --parts)
    // LoRA (or lora_slots null): per layer and fused linear (qkv, o, gate_up, down) the stacked A and B
    // (model/lora.py's layout), at [4 * layer + linear]; each row's slot, -1 for the base; the slots' rank
    const void* const* lora_a;
    const void* const* lora_b;
    const int32_t* lora_slots;
    int lora_rank;
};

enum LoraLinear { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown };

// The step's adapters' delta on a linear's output y from its input x (nothing without LoRA); widths: the
// linear's parts' output widths (q, k, v; gate, up; one for o and down).
static void add_lora(const DecodeStep* s, int layer, LoraLinear linear, const void* x, int64_t in, void* y,
                     std::initializer_list<int64_t> widths) {
    if (!s->lora_slots) return;
    const int at = 4 * layer + linear, parts = int(widths.size());
    if (s->dtype == 0)
        lora_add(static_cast<const float*>(x), in, static_cast<float*>(y), widths.begin(), parts,
                 static_cast<const float*>(s->lora_a[at]), static_cast<const float*>(s->lora_b[at]), s->lora_rank,
                 s->lora_slots, s->rows, s->num_threads);
    else
        lora_add(static_cast<const uint16_t*>(x), in, static_cast<uint16_t*>(y), widths.begin(), parts,
                 static_cast<const uint16_t*>(s->lora_a[at]), static_cast<const uint16_t*>(s->lora_b[at]),
                 s->lora_rank, s->lora_slots, s->rows, s->num_threads);
}

// Returns 0, or the first nonzero code a kernel returned (the step's outputs are then undefined).
int iterserve_decode_layers(const DecodeStep* s, const DecodeLayer* layers, int num_layers) {
    const int64_t q_size = int64_t(s->heads) * s->head_dim, kv_size = int64_t(s->kv_heads) * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, esize = s->dtype == 0 ? 4 : 2, m = s->rows;
    char* qkv = static_cast<char*>(s->qkv);
    int rc = 0;
    for (int i = 0; i < num_layers && rc == 0; ++i) {
        const DecodeLayer& l = layers[i];
        char* k_cache = s->kv_cache + i * s->layer_bytes;
        double* t = s->part_seconds;
        timed(t, kNorm, [&] {
            if (i == 0)
                s->rms_norm(s->dtype, s->x, nullptr, l.attn_norm, s->h, m, s->hidden, s->eps);
            else  // x += the last layer's MLP output, then normalized
                s->rms_norm(s->dtype, s->delta, s->x, l.attn_norm, s->h, m, s->hidden, s->eps);
        });
        timed(t, kQkv, [&] {
            rc |= s->linear(l.qkv_dtype, s->h, s->hidden, l.qkv, l.qkv_bias, qkv, m, qkv_size, s->hidden,
                            s->num_threads);
            add_lora(s, i, kLoraQkv, s->h, s->hidden, qkv, {q_size, kv_size, kv_size});
        });
        timed(t, kRope, [&] {
            s->rope(s->dtype, qkv, m, qkv_size, s->heads + s->kv_heads, s->head_dim, l.cos, l.sin, s->positions);
        });
        const char *k = qkv + q_size * esize, *v = qkv + (q_size + kv_size) * esize;
        timed(t, kWriteKv, [&] {
            if (s->write_kv_pairs)
                s->write_kv_pairs(k, qkv_size, v, qkv_size, k_cache, k_cache + s->v_offset, s->slot_mapping, m,
                                  s->kv_heads, s->head_dim, s->block_size);
            else if (s->write_kv_bf16)
                s->write_kv_bf16(k, qkv_size, v, qkv_size, k_cache, k_cache + s->v_offset, s->slot_mapping, m,
                                 kv_size);
            else if (s->write_kv_int8)
                s->write_kv_int8(s->dtype, k, qkv_size, v, qkv_size, k_cache, k_cache + s->v_offset, s->slot_mapping,
                                 m, s->kv_heads, s->head_dim);
            else
                s->write_kv(k, qkv_size * esize, v, qkv_size * esize, k_cache, k_cache + s->v_offset, s->slot_mapping,
                            m, kv_size * esize);
        });
        timed(t, kAttention, [&] {
            rc |= s->attention(s->attention_dtype, qkv, qkv_size, k_cache, k_cache + s->v_offset, s->block_tables,
                               s->table_stride, s->seq_lens, s->attn, int(m), s->heads, s->kv_heads, s->head_dim,
                               s->block_size, s->scale, s->num_threads, l.window, s->softcap);
        });
        timed(t, kO, [&] {
            rc |= s->linear(l.o_dtype, s->attn, q_size, l.o, nullptr, s->delta, m, s->hidden, q_size,
                            s->num_threads);
            add_lora(s, i, kLoraO, s->attn, q_size, s->delta, {s->hidden});
        });
        timed(t, kNorm, [&] { s->rms_norm(s->dtype, s->delta, s->x, l.mlp_norm, s->h, m, s->hidden, s->eps); });
        timed(t, kGateUp, [&] {
            rc |= s->linear(l.gate_up_dtype, s->h, s->hidden, l.gate_up, nullptr, s->gate_up, m, 2 * s->intermediate,
                            s->hidden, s->num_threads);
            add_lora(s, i, kLoraGateUp, s->h, s->hidden, s->gate_up, {s->intermediate, s->intermediate});
        });
        timed(t, kSiluMul, [&] { s->silu_mul(s->dtype, s->gate_up, s->act, m, s->intermediate); });
        timed(t, kDown, [&] {
            rc |= s->linear(l.down_dtype, s->act, s->intermediate, l.down, nullptr, s->delta, m, s->hidden,
                            s->intermediate, s->num_threads);
            add_lora(s, i, kLoraDown, s->act, s->intermediate, s->delta, {s->hidden});
        });
    }
    return rc;
}
}
