// Vector exp for the x86-64 host loops, one home for each formula:
//
//   exp16 / exp8          Cephes expf (within 2 ulp): attention's softmax (attention_cpu.cpp) and tanh (tanh_erf_cpu.cpp).
//   mlx_exp16 / mlx_exp8  MLX's own CPU exp (mlx/backend/cpu/simd/math.h), every step rounded as MLX rounds it, so
//                         the bits are mx.exp's: sigmoid and erf, whose results must be MLX's bit for bit.
//
// Inline functions with their own target attribute: include this only from x86-64 files, and call each only from
// functions compiled for (at least) its target.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <limits>

#include "kernels/avx2_vectors.h"

#define ETMLX_AVX512_EXP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

namespace etmlx::kernels {

// Whether the running CPU has what exp16's loops (AVX-512 F/BW/VL with FMA) and exp8's (AVX2 with FMA) need.
inline bool exp16_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return ok;
}

inline bool exp8_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// exp(x), 16 lanes: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by Cephes expf's polynomial (within
// 2 ulp), times 2^n by vscalefps. Below -103.9 (where expf is 0 or subnormal): exactly 0, -inf included;
// above 88.72: inf.
inline ETMLX_AVX512_EXP_TARGET __attribute__((always_inline)) __m512 exp16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.9f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

// exp(x), 8 lanes: exp16's reduction and polynomial, 2^n built in the exponent bits. Below -87.3 (where
// expf is subnormal or 0; exp16 keeps the subnormals): exactly 0, -inf included; above 88.72: inf.
ETMLX_AVX2_INLINE __m256 exp8(__m256 x) {
  const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.72f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.72f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n in [-126, 128]: 2^n as two factors, so that n = 128 (p < 1 there) stays finite where it should.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
  return _mm256_andnot_ps(zero, e);
}

// MLX's exp (simd/math.h; on x86-64 the wheel runs it one value at a time):
//   y = x * 1.442695f; i = floor(double(y) + 0.5); f = y - i
//   p = fma chain of the six constants below in f
//   e = bits((int(i) + 127) << 23) * p; e = isnan(x) ? x : e; e = x > 88 ? inf : e; e = x < -88 ? 0 : e
// Every step is one IEEE-rounded float operation, the same here. floor(double(y) + 0.5) is floor(y) plus one
// when y - floor(y) >= 0.5: that difference is exact in float, or (y in (-0.5, 0)) rounds to a value >= 0.5
// as the exact one is; where y is inf or NaN, the selects decide.
inline __attribute__((target("avx512f"), always_inline)) __m512 mlx_exp16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.442695f));
  __m512 i = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  i = _mm512_mask_add_ps(i, _mm512_cmp_ps_mask(_mm512_sub_ps(y, i), _mm512_set1_ps(0.5f), _CMP_GE_OQ), i, one);
  const __m512 f = _mm512_sub_ps(y, i);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000000000000f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(i), _mm512_set1_epi32(127)), 23);
  __m512 e = _mm512_mul_ps(_mm512_castsi512_ps(bits), p);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ),
                         _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// mlx_exp16 8 lanes at a time (the masks as blends).
ETMLX_AVX2_INLINE __m256 mlx_exp8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.442695f));
  __m256 i = _mm256_floor_ps(y);
  i = _mm256_blendv_ps(i, _mm256_add_ps(i, one), _mm256_cmp_ps(_mm256_sub_ps(y, i), _mm256_set1_ps(0.5f), _CMP_GE_OQ));
  const __m256 f = _mm256_sub_ps(y, i);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.000000000000000f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(i), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(_mm256_castsi256_ps(bits), p);
  e = _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

}  // namespace etmlx::kernels

#endif
