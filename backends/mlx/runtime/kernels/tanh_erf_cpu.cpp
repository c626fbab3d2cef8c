// tanh_cpu / erf_cpu (tanh_erf.h): 16 lanes at a time on AVX-512 (8 on AVX2+FMA), on the kernels' pool.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <mlx/ops.h>

#include "kernels/exp_vectors.h"
#include "kernels/host_kernel.h"
#include "kernels/tanh_erf.h"
#include "kernels/thread_pool.h"
#include "kernels/vector_loops.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array tanh_device(const mx::array& x) { return mx::tanh(x); }
mx::array erf_device(const mx::array& x) { return mx::erf(x); }

}  // namespace etmlx::kernels

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in quantized_rows_x86.cpp
#endif

#include <immintrin.h>

namespace etmlx::kernels {

namespace {

// MLX's erf (simd/math.h), v one lane:
//   t = 1 / fma(0.3275911, |v|, 1); r = fma chain of the five constants in t
//   e = -exp(-v * v) (MLX's exp); out = fma(e * t, r, 1); v > 0 ? out : -out
// NaN: MLX gives v's payload, quiet, with the sign bit set (its negations of a NaN); the same here.
inline ETMLX_AVX512_EXP_TARGET __attribute__((always_inline)) __m512 erf16(__m512 v) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(v)));
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  const __m512 minus_sq = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(v, v)), sign));
  const __m512 e = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mlx_exp16(minus_sq)), sign));
  const __m512 out = _mm512_fmadd_ps(_mm512_mul_ps(e, t), r, one);
  const __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(out), sign));
  const __m512 signed_out = _mm512_mask_mov_ps(negated, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), out);
  const __m512 nan = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80400000u))));
  return _mm512_mask_mov_ps(signed_out, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
}

// Cephes tanhf on |x|, the sign of x put back (so -0 stays -0): below 0.625 the odd polynomial
// a + a^3 P(a^2); else 1 - 2 / (exp(2a) + 1) (2a is exact; exp(2a) = inf from a > 44.4 gives 1). NaN: x + x.
inline ETMLX_AVX512_EXP_TARGET __attribute__((always_inline)) __m512 tanh16(__m512 x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
  const __m512 z = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), a, a);
  const __m512 e = exp16(_mm512_add_ps(a, a));
  const __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512 y = _mm512_mask_mov_ps(large, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), small);
  const __m512 s = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(y), _mm512_and_si512(_mm512_castps_si512(x), sign)));
  return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_add_ps(x, x));
}

// erf16 / tanh16 8 lanes at a time (the masks as blends).
ETMLX_AVX2_INLINE __m256 erf8(__m256 v) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 a = _mm256_andnot_ps(sign, v);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
  __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
  const __m256 e = _mm256_xor_ps(mlx_exp8(_mm256_xor_ps(_mm256_mul_ps(v, v), sign)), sign);
  const __m256 out = _mm256_fmadd_ps(_mm256_mul_ps(e, t), r, one);
  const __m256 signed_out = _mm256_blendv_ps(_mm256_xor_ps(out, sign), out, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ));
  const __m256 nan = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80400000u))));
  return _mm256_blendv_ps(signed_out, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

ETMLX_AVX2_INLINE __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), a, a);
  const __m256 e = exp8(_mm256_add_ps(a, a));
  const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 y = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
  const __m256 s = _mm256_or_ps(y, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(s, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

using Loop = void (*)(const float* x, float* out, int64_t n);

// Values per pool chunk: a multiple of 16, large enough that a chunk outweighs handing it out.
constexpr int64_t kChunk = 16384;

// The host-loop node over x's float32 values (read in row-major order, copied first when x is a view).
mx::array host_unary(const char* name, const mx::array& x, Loop loop) {
  auto body = [loop](const std::vector<mx::array>& in, mx::array& out) {
    const int64_t n = static_cast<int64_t>(in[0].size());
    std::vector<float> copy;
    const float* src = float_rows(in[0], copy);
    float* dst = out.data<float>();
    auto range = [&](int c0, int c1) {
      const int64_t b = c0 * kChunk, e = std::min<int64_t>(n, c1 * kChunk);
      loop(src + b, dst + b, e - b);
    };
    parallel_for(static_cast<int>((n + kChunk - 1) / kChunk), 1, range);
  };
  return host_kernel(name, x.shape(), mx::float32, {x}, body, /*may_reuse_input0=*/true);
}

bool applies(const mx::array& x) { return x.dtype() == mx::float32 && x.size() > 0 && (exp16_supported() || exp8_supported()); }

}  // namespace

mx::array tanh_cpu(const mx::array& x) {
  if (!applies(x)) return mx::tanh(x);
  return host_unary("TanhCpu", x, exp16_supported() ? apply16<tanh16> : apply8<tanh8>);
}

mx::array erf_cpu(const mx::array& x) {
  if (!applies(x)) return mx::erf(x);
  return host_unary("ErfCpu", x, exp16_supported() ? apply16<erf16> : apply8<erf8>);
}

}  // namespace etmlx::kernels

#else  // not x86-64: MLX's ops

namespace etmlx::kernels {

mx::array tanh_cpu(const mx::array& x) { return mx::tanh(x); }
mx::array erf_cpu(const mx::array& x) { return mx::erf(x); }

}  // namespace etmlx::kernels

#endif
