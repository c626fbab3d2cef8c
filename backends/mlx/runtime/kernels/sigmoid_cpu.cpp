// sigmoid_cpu (sigmoid.h): MLX's CPU sigmoid, 16 lanes at a time (8 without AVX-512), bit for bit.
#include <cstdint>
#include <vector>

#include <mlx/ops.h>

#include "kernels/exp_vectors.h"
#include "kernels/host_kernel.h"
#include "kernels/sigmoid.h"
#include "kernels/vector_loops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ETMLX_SIGMOID_AVX512 1
#endif

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

#ifdef ETMLX_SIGMOID_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in quantized_rows_x86.cpp
#endif

// MLX (unary_ops.h), with t = |x|: e = exp(t) (mlx_exp16: MLX's exp, the same bits); s = 1 / (1 + e);
// out = x < 0 ? s : 1 - s. Every step is one IEEE-rounded float operation, the same here.
__attribute__((target("avx512f"), always_inline)) inline __m512 sigmoid16(__m512 v) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32(0x7fffffff);
    const __m512 t = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), sign));
    const __m512 e = mlx_exp16(t);
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, e));
    return _mm512_mask_mov_ps(_mm512_sub_ps(one, s), _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), s);
}

// The same formula 8 lanes at a time for CPUs without AVX-512 (the masks as blends).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 sigmoid8(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)));
  const __m256 e = mlx_exp8(t);
  const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_blendv_ps(_mm256_sub_ps(one, s), s, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
}

// The widest loop this CPU runs; false where it has neither (mx::sigmoid then).
bool sigmoid_loop(const float* x, float* out, int64_t n) {
  if (exp16_supported()) {
    apply16<sigmoid16>(x, out, n);
    return true;
  }
  if (exp8_supported()) {
    apply8<sigmoid8>(x, out, n);
    return true;
  }
  return false;
}
#endif

}  // namespace

bool sigmoid_f32_host(const float* x, float* out, int64_t n) {
#ifdef ETMLX_SIGMOID_AVX512
  return sigmoid_loop(x, out, n);
#else
  (void)x, (void)out, (void)n;
  return false;
#endif
}

mx::array sigmoid_device(const mx::array& x) { return mx::sigmoid(x); }

mx::array sigmoid_cpu(const mx::array& x) {
#ifdef ETMLX_SIGMOID_AVX512
  if (x.dtype() == mx::float32 && x.size() > 0 && sigmoid_loop(nullptr, nullptr, 0)) {  // the probe computes nothing
    // x as MLX materialised it (no Contiguous node: SiLU's gate is a fresh product, row-contiguous);
    // another layout is copied in row-major order first.
    auto loop = [](const std::vector<mx::array>& in, mx::array& out) {
      std::vector<float> copy;
      sigmoid_loop(float_rows(in[0], copy), out.data<float>(), static_cast<int64_t>(in[0].size()));
    };
    return host_kernel("SigmoidCpu", x.shape(), mx::float32, {x}, loop, /*may_reuse_input0=*/true);
  }
#endif
  return mx::sigmoid(x);
}

}  // namespace etmlx::kernels
