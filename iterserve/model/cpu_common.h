// Helpers shared by the CPU kernels (cpu_attention.cpp, cpu_ops.cpp): bfloat16 <-> float32 rounded
// as torch rounds, and the AVX-512 and AVX2 loads, stores and the vector exps they use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16 is the high half of a float32
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even, as torch does; no branch
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    *out = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40 : rounded);  // NaN stays NaN
}

template <typename T> inline float round_trip(float x) {  // x as the model dtype would hold it
    T t;
    from_f32(x, &t);
    return to_f32(t);
}

// 2^f for |f| <= 1/2: degree-6 Taylor coefficients, highest first (the vector exps below).
constexpr float kExp2Taylor[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                  2.4022651e-1f, 6.9314718e-1f, 1.f};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512i bf16_bits(__m512 x) {  // from_f32 on 16 lanes, each result in its lane's low half
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}

template <typename T> inline __m512 round_trip16(__m512 x);
template <> inline __m512 round_trip16<float>(__m512 x) { return x; }
template <> inline __m512 round_trip16<uint16_t>(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
}

inline __m512 exp16(__m512 x) {  // 2^n * 2^f with |f| <= 1/2; degree-6 Taylor of 2^f, rel. error ~1e-7
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__)
// The same on 8 lanes (the AVX2 paths).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load8(const int8_t* p) {  // an int8 cache's or weight's codes, widened
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256i bf16_bits8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(uint16_t* p, __m256 x) {
    const __m256i bits = bf16_bits8(x);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);  // lanes 0-3, 4-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename T> inline __m256 round_trip8(__m256 x);
template <> inline __m256 round_trip8<float>(__m256 x) { return x; }
template <> inline __m256 round_trip8<uint16_t>(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {  // exp16 on 8 lanes, 2^n built in the exponent bits (AVX2 has no scalef)
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(kExp2Taylor[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

}  // namespace
