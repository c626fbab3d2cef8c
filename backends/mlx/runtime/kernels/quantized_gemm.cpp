// quantized_gemm.h: dequantize-in-tiles float32 GEMM, AVX-512 (functions with their own target
// attribute, so the library stays baseline x86-64; other CPUs keep the dequantize-then-BLAS path).
#include "kernels/quantized_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "kernels/quantized_gemm_avx2.h"
#include "kernels/quantized_gemm_vnni.h"
#include "kernels/quantized_rows_variants.h"
#include "kernels/thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see quantized_rows_x86.cpp)
#endif

#include <immintrin.h>

namespace etmlx::kernels {

namespace {

#define ETMLX_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define ETMLX_INLINE inline __attribute__((always_inline))

// Register tile: kTileN rows of W (each value broadcast) times kTileM activation rows (two vectors of
// 16): 28 accumulators, 2 activation vectors and a broadcast fill the 32 vector registers; per k, 28
// FMAs against 16 loads, so the loop is bound by the FMA units, not by the loads.
constexpr int kTileN = 14;
constexpr int kTileM = 32;
// Padding of a dequantized row, in floats: rows a multiple of 4 KB apart would all fall in the same L1
// set, and the kernel reads 14 of them side by side.
constexpr int kRowPad = 16;

// W rows a thread dequantizes at once, in tiles: about 512 KB of float32 (in a 1-2 MB L2), from 2 to 8
// tiles. Each 32-row activation panel (read from L3 at 512 rows) then serves that many tiles. Measured
// on one thread (Zen 5, 512 x 896 x 4864 and 512 x 4864 x 896): this beat blocking k (1024 or 256 with
// more tiles: the partial sums' transposed read-modify-write of the output cost more than it saved).
constexpr int64_t kBufferBytes = 1 << 19;
int tiles_per_block(int k) {
  return static_cast<int>(std::clamp<int64_t>(kBufferBytes / (int64_t{kTileN} * (k + kRowPad) * 4), 2, 8));
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], AlignedFree>;

Buffer aligned_floats(size_t count) {
  const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
  if (p == nullptr) throw std::bad_alloc();
  return Buffer(p);
}

// buf[r * ld + i] = W[n0 + r, i]; rows past w.n are 0.
template <int BITS, ScaleType T>
ETMLX_AVX512 void dequantize_block(const QuantizedMatrix& w, int n0, int rows, float* buf, int ld) {
  const int groups = w.k / w.group;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int r = 0; r < rows; ++r) {
    float* o = buf + static_cast<int64_t>(r) * ld;
    const int n = n0 + r;
    if (n >= w.n) {
      std::memset(o, 0, sizeof(float) * w.k);
      continue;
    }
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const __m512 s = _mm512_set1_ps(load_scale<T>(w.scales, at)), b = _mm512_set1_ps(load_scale<T>(w.biases, at));
      for (int i = g * w.group; i < (g + 1) * w.group; i += 16) {
        __m128i q;
        if constexpr (BITS == 4) {  // 8 bytes, low nibble first: interleave the low and high nibbles
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + i / 2));
          const __m128i mask = _mm_set1_epi8(0x0f);
          q = _mm_unpacklo_epi8(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
        } else {
          q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + i));
        }
        _mm512_store_ps(o + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), s, b));
      }
    }
  }
}

// acc[r][h] lane j += sum over k < kc of wt[r * ldw + k] * panel[k * 32 + 16 h + j].
ETMLX_AVX512 ETMLX_INLINE void tile_kernel(const float* wt, int ldw, const float* panel, int kc,
                                           __m512 (&acc)[kTileN][2]) {
  for (int k = 0; k < kc; ++k) {
    const __m512 x0 = _mm512_load_ps(panel + k * kTileM), x1 = _mm512_load_ps(panel + k * kTileM + 16);
    ETMLX_UNROLL
    for (int r = 0; r < kTileN; ++r) {
      const __m512 a = _mm512_set1_ps(wt[r * ldw + k]);
      acc[r][0] = _mm512_fmadd_ps(a, x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, x1, acc[r][1]);
    }
  }
}

struct Gemm {
  const QuantizedMatrix& w;
  const float* panels;  // [ceil(m / 32)][k][32]: activation rows m0..m0+31 side by side, zero-padded
  int m;
  float* out;           // [m, w.n]

  // W tiles [t0, t1) (tile t = rows 14 t .. 14 t + 13), for every activation row.
  template <int BITS, ScaleType T>
  ETMLX_AVX512 void tiles(int t0, int t1, float* buf) const {
    const int ld = w.k + kRowPad;
    dequantize_block<BITS, T>(w, t0 * kTileN, (t1 - t0) * kTileN, buf, ld);
    for (int m0 = 0; m0 < m; m0 += kTileM) {
      const float* panel = panels + static_cast<int64_t>(m0) * w.k;
      const int rows_m = std::min(kTileM, m - m0);
      for (int t = t0; t < t1; ++t) {
        __m512 acc[kTileN][2];
        ETMLX_UNROLL
        for (int r = 0; r < kTileN; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        tile_kernel(buf + static_cast<int64_t>(t - t0) * kTileN * ld, ld, panel, w.k, acc);
        alignas(64) float c[kTileN][kTileM];
        ETMLX_UNROLL
        for (int r = 0; r < kTileN; ++r) {
          _mm512_store_ps(c[r], acc[r][0]);
          _mm512_store_ps(c[r] + 16, acc[r][1]);
        }
        const int n0 = t * kTileN, rows_n = std::min(kTileN, w.n - n0);
        for (int j = 0; j < rows_m; ++j) {
          float* o = out + static_cast<int64_t>(m0 + j) * w.n + n0;
          for (int r = 0; r < rows_n; ++r) o[r] = c[r][j];
        }
      }
    }
  }
};

void pack_panels(const float* x, int m, int k, float* panels) {
  auto range = [&](int b0, int b1) {
    for (int b = b0; b < b1; ++b) {
      float* p = panels + static_cast<int64_t>(b) * kTileM * k;
      const int rows = std::min(kTileM, m - b * kTileM);
      for (int kk = 0; kk < k; ++kk) {
        for (int j = 0; j < kTileM; ++j) {
          p[kk * kTileM + j] = j < rows ? x[static_cast<int64_t>(b * kTileM + j) * k + kk] : 0.0f;
        }
      }
    }
  };
  const int blocks = (m + kTileM - 1) / kTileM;
  parallel_for(blocks, 1, range);
}

// The AVX2 integer GEMM serves where the few-row loop in use is AVX2's (so ETMLX_QMM_ISA=scalar keeps the
// dequantize-then-BLAS path).
bool avx2_integer(int bits, int group) {
  static const bool ok = std::strcmp(quantized_rows_isa(), "avx2") == 0;
  return ok && quantized_gemm_avx2_available(bits, group);
}

}  // namespace

bool quantized_gemm_available() {
  static const bool ok = [] {
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
      return false;
    }
    return std::strcmp(quantized_rows_isa(), "avx512") == 0;
  }();
  return ok;
}

bool quantized_gemm_integer(int bits, int group, ActivationPrecision p) {
  if (p == ActivationPrecision::float32) return false;
  return (quantized_gemm_available() && quantized_gemm_vnni_available(bits, group)) || avx2_integer(bits, group);
}

void quantized_gemm(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out) {
  if (quantized_gemm_integer(w.bits, w.group, p)) {
    // Integer activations (quantized_gemm_vnni.h, quantized_gemm_avx2.h).
    if (quantized_gemm_available() && quantized_gemm_vnni_available(w.bits, w.group)) {
      quantized_gemm_vnni(x, m, w, p, out);
    } else {
      quantized_gemm_avx2(x, m, w, p, out);
    }
    return;
  }
  const int blocks = (m + kTileM - 1) / kTileM;
  // Kept between calls (on MLX's CPU thread, which makes them): a fresh 10 MB buffer per linear cost page
  // faults and zeroing, ~7% of a prefill's samples.
  thread_local Buffer panels;
  thread_local size_t panel_floats = 0;
  const size_t need_panels = static_cast<size_t>(blocks) * kTileM * w.k;
  if (panel_floats < need_panels) panels = aligned_floats(need_panels), panel_floats = need_panels;
  pack_panels(x, m, w.k, panels.get());
  const Gemm gemm{w, panels.get(), m, out};
  const int tiles = (w.n + kTileN - 1) / kTileN;
  // At least two ranges per thread, so that a thread the shared machine slows does not hold up the rest.
  const int per_block = tiles_per_block(w.k);
  const int grain = std::clamp(tiles / (2 * pool_threads()), 1, per_block);
  auto range = [&](int t0, int t1) {
    thread_local Buffer buf;
    thread_local size_t buf_floats = 0;
    const size_t need = static_cast<size_t>(per_block) * kTileN * (w.k + kRowPad);
    if (buf_floats < need) buf = aligned_floats(need), buf_floats = need;
    for (int t = t0; t < t1; t += per_block) {
      const int t_end = std::min(t1, t + per_block);
      dispatch_dequantize(w.bits, w.scale_type,
                          [&]<int B, ScaleType T>() { gemm.tiles<B, T>(t, t_end, buf.get()); });
    }
  };
  parallel_for(tiles, grain, range);
}

}  // namespace etmlx::kernels

#else  // not x86-64: the dequantize-then-BLAS path (quantized_matmul_cpu.cpp)

namespace etmlx::kernels {
bool quantized_gemm_available() { return false; }
bool quantized_gemm_integer(int, int, ActivationPrecision) { return false; }
void quantized_gemm(const float*, int, const QuantizedMatrix&, ActivationPrecision, float*) { std::abort(); }
}  // namespace etmlx::kernels

#endif
