// The element-wise host loops' one loop shape: out[i] = F(x[i]) over n floats, 16 lanes at a time on AVX-512
// (the tail masked) or 8 on AVX2 + FMA (the tail through a padded copy). F is a vector function such as
// sigmoid16 (sigmoid_cpu.cpp) or tanh16 / erf16 (tanh_erf_cpu.cpp), inlined into the loop: it must be compiled
// for a subset of the loop's target. Call apply16 only where exp16_supported(), apply8 where exp8_supported()
// (exp_vectors.h). x86-64 only.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/exp_vectors.h"

namespace etmlx::kernels {

template <__m512 (*F)(__m512)>
ETMLX_AVX512_EXP_TARGET void apply16(const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, F(_mm512_loadu_ps(x + j)));
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(out + j, tail, F(_mm512_maskz_loadu_ps(tail, x + j)));
  }
}

template <__m256 (*F)(__m256)>
ETMLX_AVX2_TARGET void apply8(const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, F(_mm256_loadu_ps(x + j)));
  if (j < n) {  // the last partial vector through a padded copy
    alignas(32) float tail[8] = {};
    std::memcpy(tail, x + j, sizeof(float) * static_cast<size_t>(n - j));
    _mm256_store_ps(tail, F(_mm256_load_ps(tail)));
    std::memcpy(out + j, tail, sizeof(float) * static_cast<size_t>(n - j));
  }
}

}  // namespace etmlx::kernels

#endif
