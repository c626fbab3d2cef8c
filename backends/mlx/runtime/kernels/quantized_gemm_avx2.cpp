// quantized_gemm_avx2.h: the integer-activation GEMM on AVX2 (functions with their own target attribute, so
// the library stays baseline x86-64).
#include "kernels/quantized_gemm_avx2.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/quantized_rows_variants.h"
#include "kernels/thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include "kernels/avx2_vectors.h"

namespace etmlx::kernels {

namespace {

constexpr int kTileW = 8;                // W rows per tile: one int32 lane each
constexpr int kTileX = 4;                // activation rows per register tile
constexpr int kStepBytes = kTileW * 4;  // one k step (4 values) of a W tile: one vector
constexpr int kPairSteps = 8;            // k steps whose 16-bit pair sums add up exactly (8 * 3840 <= 32767)

// A call's activations, rounded once: the few-row loop's prepared rows for all m rows.
struct Activations {
  int8_t* hi;
  int8_t* lo;  // int16 only
  float* steps;
  float* sums;
  float* residuals;
};

// A thread's unpacked W tile: bytes [k / 4][8][4] in the activations' order, scales and biases [groups][8].
struct Tile {
  std::vector<uint8_t> storage;
  uint8_t* bytes = nullptr;
  float* scales = nullptr;
  float* biases = nullptr;
  void reserve(int k, int groups) {
    const size_t need = static_cast<size_t>(k) * kTileW + 2 * sizeof(float) * groups * kTileW + 32;
    if (storage.size() < need) storage.resize(need);
    bytes = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 31) & ~uintptr_t{31});
    scales = reinterpret_cast<float*>(bytes + static_cast<size_t>(k) * kTileW);
    biases = scales + static_cast<size_t>(groups) * kTileW;
  }
};

// Words j of the 8 vectors r[0..7] (8 words each) into vector j: an 8 x 8 transpose of 4-byte words.
ETMLX_AVX2_INLINE void transpose8(const __m256i r[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]);      // words 0, 1 | 4, 5 of rows 2p, 2p + 1
    t[2 * p + 1] = _mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]);  // words 2, 3 | 6, 7
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7: per 128-bit half, words (0|4), (1|5), (2|6), (3|7)
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// W rows n0 .. n0 + 7 (rows past w.n: 0) into the tile. Per 64 values a row's 32 packed bytes become its 32 low
// nibbles (the even values) and 32 high ones (the odd values), the order prepare_integer_avx2 gives the
// activations, then two 8 x 8 word transposes make one vector per k step.
template <ScaleType T>
ETMLX_AVX2_TARGET void unpack_tile(const QuantizedMatrix& w, int n0, Tile& tile) {
  const int groups = w.k / w.group;
  const int64_t row_bytes = static_cast<int64_t>(w.k) / 2;
  const int rows = std::min(kTileW, w.n - n0);
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(w.w) + n0 * row_bytes;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int b = 0; b < w.k / kIntBlock; ++b) {
    __m256i even[kTileW], odd[kTileW], out[kTileW];
    for (int r = 0; r < kTileW; ++r) {
      const __m256i v = r < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + r * row_bytes + b * 32))
                                 : _mm256_setzero_si256();
      even[r] = _mm256_and_si256(v, nibble);
      odd[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    uint8_t* dst = tile.bytes + static_cast<int64_t>(b) * 16 * kStepBytes;
    transpose8(even, out);
    for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + j * kStepBytes), out[j]);
    transpose8(odd, out);
    for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + (8 + j) * kStepBytes), out[j]);
  }
  for (int r = 0; r < kTileW; ++r) {
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n0 + r) * groups + g;
      tile.scales[g * kTileW + r] = r < rows ? load_scale<T>(w.scales, at) : 0.0f;
      tile.biases[g * kTileW + r] = r < rows ? load_scale<T>(w.biases, at) : 0.0f;
    }
  }
}

// c[r] = activation row m0 + r . W tile row j (lane j) for r < R: per group, the integer sums acc[r] (int16:
// 256 * (qw . hi) + qw . lo, the 256 applied by vpmaddwd), then one multiply and three multiply-adds,
// c += (acc * scale) * step + bias * sum(x) + (centre * scale) * residual, centre = 8 (quantized_gemm_vnni.h).
// Every row runs the same instructions whatever R is: its bits do not depend on its neighbours.
template <bool INT16, int R, int STEPS>
ETMLX_AVX2_TARGET void tile_kernel(const Tile& tile, const Activations& a, int m0, int k, int groups, __m256 (&c)[kTileX]) {
  constexpr int group = STEPS * 4;
  const __m256i ones = _mm256_set1_epi16(1), high = _mm256_set1_epi16(INT16 ? 256 : 1);
  __m256 cr[R];
  ETMLX_UNROLL
  for (int r = 0; r < R; ++r) cr[r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m256i acc[R];
    ETMLX_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int plane = 0; plane < (INT16 ? 2 : 1); ++plane) {
      const __m256i weight = plane == 0 ? high : ones;
      const int8_t* base = plane == 0 ? a.hi : a.lo;
      const int8_t* x[R];
      ETMLX_UNROLL
      for (int r = 0; r < R; ++r) x[r] = base + static_cast<int64_t>(m0 + r) * k + static_cast<int64_t>(g) * group;
      const uint8_t* wg = tile.bytes + static_cast<int64_t>(g) * STEPS * kStepBytes;
      for (int s0 = 0; s0 < STEPS; s0 += kPairSteps) {
        __m256i pairs[R];
        ETMLX_UNROLL
        for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int s = s0; s < s0 + kPairSteps; ++s) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg + s * kStepBytes));
          ETMLX_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x[r] + 4 * s)));
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(wv, xv));
          }
        }
        ETMLX_UNROLL
        for (int r = 0; r < R; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs[r], weight));
      }
    }
    const __m256 s = _mm256_load_ps(tile.scales + g * kTileW), b = _mm256_load_ps(tile.biases + g * kTileW);
    const __m256 cs = _mm256_mul_ps(s, _mm256_set1_ps(8.0f));  // exact: a power of 2
    ETMLX_UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t at = static_cast<int64_t>(m0 + r) * groups + g;
      cr[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r]), s), _mm256_set1_ps(a.steps[at]), cr[r]);
      cr[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(a.sums[at]), cr[r]);
      cr[r] = _mm256_fmadd_ps(cs, _mm256_set1_ps(a.residuals[at]), cr[r]);
    }
  }
  ETMLX_UNROLL
  for (int r = 0; r < R; ++r) c[r] = cr[r];
}

template <bool INT16, int STEPS>
ETMLX_AVX2_TARGET void tile_rows(const Tile& tile, const Activations& a, int m0, int rows, int k, int groups,
                          __m256 (&c)[kTileX]) {
  switch (rows) {
    case 1: return tile_kernel<INT16, 1, STEPS>(tile, a, m0, k, groups, c);
    case 2: return tile_kernel<INT16, 2, STEPS>(tile, a, m0, k, groups, c);
    case 3: return tile_kernel<INT16, 3, STEPS>(tile, a, m0, k, groups, c);
    default: return tile_kernel<INT16, 4, STEPS>(tile, a, m0, k, groups, c);
  }
}

template <ScaleType T, bool INT16, int STEPS>
ETMLX_AVX2_TARGET void tiles(const QuantizedMatrix& w, const Activations& a, int m, int t0, int t1, float* out) {
  const int groups = w.k / w.group;
  thread_local Tile tile;  // kept between calls, as the VNNI kernel's buffers
  tile.reserve(w.k, groups);
  for (int t = t0; t < t1; ++t) {
    const int n0 = t * kTileW, cols = std::min(kTileW, w.n - n0);
    unpack_tile<T>(w, n0, tile);
    for (int m0 = 0; m0 < m; m0 += kTileX) {
      const int rows = std::min(kTileX, m - m0);
      __m256 c[kTileX];
      tile_rows<INT16, STEPS>(tile, a, m0, rows, w.k, groups, c);
      for (int r = 0; r < rows; ++r) {
        float* o = out + static_cast<int64_t>(m0 + r) * w.n + n0;
        if (cols == kTileW) {
          _mm256_storeu_ps(o, c[r]);
        } else {
          alignas(32) float v[kTileW];
          _mm256_store_ps(v, c[r]);
          std::memcpy(o, v, sizeof(float) * cols);
        }
      }
    }
  }
}

}  // namespace

bool quantized_gemm_avx2_available(int bits, int group) {
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return cpu && bits == 4 && (group == 64 || group == 128);
}

void quantized_gemm_avx2(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out) {
  if (!quantized_gemm_avx2_available(w.bits, w.group) || p == ActivationPrecision::float32) std::abort();
  const bool int16 = p == ActivationPrecision::int16;
  const int k = w.k, groups = k / w.group;
  // Kept between calls, on the thread that makes them (MLX's CPU thread).
  thread_local std::vector<int8_t> hi, lo;
  thread_local std::vector<float> steps, sums, residuals;
  hi.resize(static_cast<size_t>(m) * k);
  if (int16) lo.resize(static_cast<size_t>(m) * k);
  steps.resize(static_cast<size_t>(m) * groups);
  sums.resize(steps.size());
  residuals.resize(steps.size());
  // The pointers, not the thread_local vectors, go to the pool threads (each has vectors of its own).
  const Activations a{hi.data(), int16 ? lo.data() : nullptr, steps.data(), sums.data(), residuals.data()};
  auto prepare = [&a, x, k, groups, &w, p](int r0, int r1) {
    const int64_t xo = static_cast<int64_t>(r0) * k, go = static_cast<int64_t>(r0) * groups;
    prepare_integer_avx2(x + xo, r1 - r0, k, 4, w.group, p, a.hi + xo, a.lo ? a.lo + xo : nullptr, a.steps + go,
                             a.residuals + go, a.sums + go);
  };
  parallel_for(m, 1, prepare);
  const int tiles_n = (w.n + kTileW - 1) / kTileW;
  // About four ranges per thread, so that a thread the shared machine slows does not hold up the rest.
  const int grain = std::max(1, tiles_n / (4 * pool_threads()));
  auto range = [&](int t0, int t1) {
    dispatch_dequantize(4, w.scale_type, [&]<int B, ScaleType T>() {
      if (int16) {
        w.group == 64 ? tiles<T, true, 16>(w, a, m, t0, t1, out) : tiles<T, true, 32>(w, a, m, t0, t1, out);
      } else {
        w.group == 64 ? tiles<T, false, 16>(w, a, m, t0, t1, out) : tiles<T, false, 32>(w, a, m, t0, t1, out);
      }
    });
  };
  parallel_for(tiles_n, grain, range);
}

}  // namespace etmlx::kernels

#else  // not x86-64

namespace etmlx::kernels {
bool quantized_gemm_avx2_available(int, int) { return false; }
void quantized_gemm_avx2(const float*, int, const QuantizedMatrix&, ActivationPrecision, float*) { std::abort(); }
}  // namespace etmlx::kernels

#endif
