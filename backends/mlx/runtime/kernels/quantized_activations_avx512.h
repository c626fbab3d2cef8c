// quantize_activation_group's rounding (quantized_activations.h) 16 lanes at a time, for the two AVX-512
// VNNI loops that lay the integers out each their own way: the few-row loop's rows
// (quantized_rows_x86.cpp) and the many-row GEMM's panels (quantized_gemm_vnni.cpp). The same integers
// and steps as quantize_activation_group; the group's sum and residual summed in 16 lanes, then reduced.
//
// Inline functions with their own target attribute: include this only from x86-64 files, and call it only
// from functions compiled for AVX-512 F+BW+VNNI.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <cmath>

#include "kernels/quantized_activations.h"

// The instruction set of every AVX-512 VNNI loop (the few-row loop, the GEMM) and of these helpers, in one
// place: an always_inline function only inlines into callers compiled for the same target.
#define ETMLX_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
#define ETMLX_ROUNDING inline ETMLX_VNNI_TARGET __attribute__((always_inline))

namespace etmlx::kernels::avx512 {

// One group's rounding: its float32 sum, the step (max|x| / qmax; 0 for an all-zero or padding group, NaN
// when a value is not finite) and, for a group that has integers, the multiplier qmax / max|x|.
struct GroupRounding {
  float sum = 0.0f, step = 0.0f;
  bool zero = true;  // every integer is 0 (all zeros, padding, or not finite)
  __m512 inverse, vstep;
  __m512i top, bottom;

  // The integers of 16 values v (float32 multiply, round to nearest even, clamp to +-qmax), and
  // residual += v - step * q, each rounded once. Only for a group that is not `zero`.
  ETMLX_ROUNDING __m512i round(__m512 v, __m512& residual) const {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));  // MXCSR's round to nearest even
    q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
    residual = _mm512_add_ps(residual, _mm512_fnmadd_ps(vstep, _mm512_cvtepi32_ps(q), v));
    return q;
  }
};

// x[0..count) (count a multiple of 16; null: a padding group of zeros) at `qmax`.
ETMLX_ROUNDING GroupRounding group_rounding(const float* x, int count, int qmax) {
  GroupRounding g;
  if (x == nullptr) return g;
  __m512 largest = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int i = 0; i < count; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
    sum = _mm512_add_ps(sum, v);
    const __m512 d = _mm512_sub_ps(v, v);  // NaN for inf and NaN
    bad |= _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q);
  }
  g.sum = _mm512_reduce_add_ps(sum);
  const float most = _mm512_reduce_max_ps(largest);
  if (bad != 0) {
    g.step = std::nanf("");
    return g;
  }
  if (most == 0.0f) return g;
  g.zero = false;
  g.step = most / static_cast<float>(qmax);
  g.inverse = _mm512_set1_ps(static_cast<float>(qmax) / most);
  g.vstep = _mm512_set1_ps(g.step);
  g.top = _mm512_set1_epi32(qmax);
  g.bottom = _mm512_set1_epi32(-qmax);
  return g;
}

// The residual of a group from its 16 lanes: NaN for a non-finite group, 0 for a zero one.
ETMLX_ROUNDING float group_residual(const GroupRounding& g, __m512 residual) {
  return std::isnan(g.step) ? std::nanf("") : _mm512_reduce_add_ps(residual);
}

// int16: q = 256 * hi + lo, lo the signed low byte of q (in [-128, 127]) and hi in [-127, 127].
ETMLX_ROUNDING void split_int16(__m512i q, __m512i& hi, __m512i& lo) {
  lo = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);
  hi = _mm512_srai_epi32(_mm512_sub_epi32(q, lo), 8);
}

}  // namespace etmlx::kernels::avx512

#undef ETMLX_ROUNDING

#endif
