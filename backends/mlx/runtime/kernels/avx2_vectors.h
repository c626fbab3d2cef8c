// Small AVX2 helpers that several x86-64 host loops share (attention_cpu.cpp, quantized_rows_x86.cpp,
// quantized_gemm_avx2.cpp): the target attribute, horizontal sums and maxima, the mask of a vector's first
// lanes. One home, so that every loop reduces its lanes in the same order.
//
// Inline functions with their own target attribute: include this only from x86-64 files, and call them only
// from functions compiled for AVX2+FMA (ETMLX_AVX2_TARGET or wider).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <algorithm>

// An always_inline function only inlines into callers compiled for (at least) the same target.
#define ETMLX_AVX2_TARGET __attribute__((target("avx2,fma")))
#define ETMLX_AVX2_INLINE inline ETMLX_AVX2_TARGET __attribute__((always_inline))

namespace etmlx::kernels::avx2 {

// The sum of 8 lanes: the two halves added lane by lane (l_i + l_{i+4}), then lanes 0 + 2 and 1 + 3, then
// those two.
ETMLX_AVX2_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of four vectors' lanes at once, each in hsum's order (so bit for bit hsum(a), ..., hsum(d)).
ETMLX_AVX2_INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m128 x0 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 x1 = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  __m128 x2 = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
  __m128 x3 = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
  _MM_TRANSPOSE4_PS(x0, x1, x2, x3);  // x_i now holds lane i of each vector
  return _mm_add_ps(_mm_add_ps(x0, x2), _mm_add_ps(x1, x3));
}

// The largest of 8 lanes, in hsum's order.
ETMLX_AVX2_INLINE float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight bfloat16 values as float32 (exact: a bfloat16 is a float32's high half).
ETMLX_AVX2_INLINE __m256 bf16_to_f32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The mask of a vector's first n lanes (all 8 from n = 8 on), for maskload / maskstore.
ETMLX_AVX2_INLINE __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(std::min(n, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

}  // namespace etmlx::kernels::avx2

#endif
