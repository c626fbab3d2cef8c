// quantized_rows.h on x86-64: AVX2+FMA and AVX-512 variants. Every function using them carries
// its own target attribute (the rest of the library stays baseline x86-64), and a variant is
// offered only when the running CPU (and OS) supports it.
#include "kernels/quantized_rows_variants.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// GCC 12's AVX-512 headers make their "undefined" pass-through operands by self-assignment, which
// -Wmaybe-uninitialized reports at every inlined intrinsic; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstring>

#include "kernels/avx2_vectors.h"

#include "kernels/quantized_activations_avx512.h"

namespace etmlx::kernels {

namespace {

#define ETMLX_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define ETMLX_INLINE inline __attribute__((always_inline))

// ---- AVX2: a chunk of 32 values is 4 vectors of 8 floats ----

// The chunk's integers as floats in prepared order (quantized_rows.h): at 4 bits, the 16 low
// nibbles then the 16 high ones; at 8 bits, the 32 bytes in order.
template <int BITS>
ETMLX_AVX2_INLINE void chunk_avx2(const uint8_t* p, __m256* q) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
  } else {
    ETMLX_UNROLL
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
    }
  }
}

template <int BITS, int M, ScaleType T>
ETMLX_AVX2_TARGET void dot_avx2(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                         int64_t ldo) {
  // Two independent sums per row and group (a single FMA chain would be latency-bound), the same
  // for every row count: a row's result then does not depend on how many rows the call has.
  constexpr int NA = 2;
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    __m256 total[M];
    float bias_part[M];
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) total[r] = _mm256_setzero_ps(), bias_part[r] = 0.0f;
    const float* x = rows.x;
    for (int g = 0; g < groups; ++g) {
      __m256 acc[M][NA];
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r)
        ETMLX_UNROLL
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
      for (int c = 0; c < chunks; ++c, wb += chunk_bytes, x += kChunk) {
        __m256 q[4];
        chunk_avx2<BITS>(wb, q);
        ETMLX_UNROLL
        for (int r = 0; r < M; ++r) {
          const float* xr = x + static_cast<int64_t>(r) * w.k;
          ETMLX_UNROLL
          for (int i = 0; i < 4; ++i) acc[r][i % NA] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % NA]);
        }
      }
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const __m256 s = _mm256_set1_ps(load_scale<T>(w.scales, at));
      const float b = load_scale<T>(w.biases, at);
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        __m256 a = acc[r][0];
        ETMLX_UNROLL
        for (int i = 1; i < NA; ++i) a = _mm256_add_ps(a, acc[r][i]);
        total[r] = _mm256_fmadd_ps(a, s, total[r]);
        bias_part[r] += b * rows.group_sums[static_cast<int64_t>(r) * groups + g];
      }
    }
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) out[r * ldo + (n - n_begin)] = avx2::hsum(total[r]) + bias_part[r];
  }
}

// How far ahead of each row's reads the packed weights are prefetched. A decode step streams every
// weight from memory once (a 4-bit Qwen2.5-0.5B: 312 MB, far beyond the cache), and one core's
// hardware prefetch alone kept it under its memory bandwidth: measured on one thread of an AVX-512
// EPYC, 896 -> 151936 (68 MB) took ~30% less time with a 4 KB lead (1 KB: no gain; 8-16 KB: no better).
constexpr int kPrefetchBytes = 4096;

// ---- AVX2 without VNNI: integer activations at 4 bits, a block of 64 values per two vpmaddubsw ----
//
// What dot_block_vnni does with vpdpbusd, from AVX2's vpmaddubsw (unsigned weight byte times signed activation
// byte, adjacent pairs summed into 16 bits) and vpmaddwd (pairs of those into 32 bits). At 4 bits a pair
// is at most 2 * 15 * 128 = 3840, and the two halves of a block summed in 16 bits at most 7680: exact, no
// saturation. (At 8 bits a pair could reach 2 * 255 * 128 and saturate, so 8-bit weights keep the float32 loop.)
// The integers and the per-group terms (scale * step * integer sum, bias * sum of x, the rounding term) are
// dot_block_vnni's; the float32 sums add them in another order.

// Eight consecutive per-group values from `at` on, the first `count` (1..8) of them, as float32 (the other
// lanes 0).
template <ScaleType T>
ETMLX_AVX2_INLINE __m256 group_values8(const void* base, int64_t at, int count) {
  if constexpr (T == ScaleType::f32) {
    if (count == 8) return _mm256_loadu_ps(static_cast<const float*>(base) + at);
    return _mm256_maskload_ps(static_cast<const float*>(base) + at, avx2::first_lanes(count));
  } else if constexpr (T == ScaleType::bf16) {
    // A bfloat16 is a float32's high half: widen to 32 bits, shift into place. (A scalar loop through the
    // stack here, or a partial copy there, stalled the load after it: ~30% of a 4-bit Qwen2.5-0.5B's decode
    // step on AVX2, whose ~455k W rows a step each read their 14 groups' scales and biases here.)
    const uint16_t* p = static_cast<const uint16_t*>(base) + at;
    if (count == 8) return avx2::bf16_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (at + count >= 8) {
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      // The 8 values that end with the last one wanted (all inside the array), moved down 8 - count lanes.
      const __m256i v = _mm256_castps_si256(avx2::bf16_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + count - 8))));
      const __m256i moved = _mm256_permutevar8x32_epi32(v, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 - count)));
      return _mm256_castsi256_ps(_mm256_and_si256(moved, avx2::first_lanes(count)));
    }
    alignas(16) uint16_t v[8] = {};
    std::memcpy(v, p, sizeof(uint16_t) * count);
    return avx2::bf16_to_f32(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
  } else {
    alignas(32) float v[8] = {};
    for (int i = 0; i < count; ++i) v[i] = load_scale<T>(base, at + i);
    return _mm256_load_ps(v);
  }
}

// Row r's terms of W row `n` that do not involve the integer products: the sum over groups of
// bias * sum(x) + 2^(bits-1) * scale * residual (PreparedRows::residuals), 8 groups a vector. In the
// group loop these were two dependent scalar multiply-adds a group, a chain that set the loop's pace.
template <ScaleType T>
ETMLX_AVX2_INLINE __m256 bias_terms(const QuantizedMatrix& w, const PreparedRows& rows, int n, int r,
                                          int groups) {
  __m256 acc = _mm256_setzero_ps();
  for (int g = 0; g < groups; g += 8) {
    const int count = std::min(8, groups - g);
    const int64_t at = static_cast<int64_t>(n) * groups + g, rg = static_cast<int64_t>(r) * groups + g;
    const __m256 centre = _mm256_mul_ps(group_values8<T>(w.scales, at, count), _mm256_set1_ps(8.0f));
    acc = _mm256_fmadd_ps(group_values8<T>(w.biases, at, count), group_values8<ScaleType::f32>(rows.group_sums, rg, count), acc);
    acc = _mm256_fmadd_ps(centre, group_values8<ScaleType::f32>(rows.residuals, rg, count), acc);
  }
  return acc;
}

// BLOCKS: kIntBlock blocks a group (1 or 2: groups of 64 or 128), fixed at compile time so that a group is
// straight-line code.
template <int M, ScaleType T, bool INT16, int NB, int BLOCKS>
ETMLX_AVX2_INLINE void dot_block_avx2_int(const QuantizedMatrix& w, const PreparedRows& rows, int n,
                                                float* out, int64_t ldo) {
  constexpr int block_bytes = kIntBlock / 2;
  const int groups = w.k / w.group;
  const int64_t row_bytes = static_cast<int64_t>(w.k) / 2;
  // INT16: the high bytes' pair sums weigh 256, by their vpmaddwd (no shift and add per group).
  const __m256i ones = _mm256_set1_epi16(1), high = _mm256_set1_epi16(INT16 ? 256 : 1);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const uint8_t* wb[NB];
  const int8_t *hi[M], *lo[M];
  const float* steps[M];
  __m256 total[NB][M];
  ETMLX_UNROLL
  for (int r = 0; r < M; ++r) {
    hi[r] = rows.hi + static_cast<int64_t>(r) * w.k;
    lo[r] = INT16 ? rows.lo + static_cast<int64_t>(r) * w.k : hi[r];
    steps[r] = rows.steps + static_cast<int64_t>(r) * groups;
  }
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j) {
    wb[j] = reinterpret_cast<const uint8_t*>(w.w) + (n + j) * row_bytes;
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) total[j][r] = bias_terms<T>(w, rows, n + j, r, groups);
  }
  for (int g = 0; g < groups; ++g) {
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wb[j]) + kPrefetchBytes, _MM_HINT_T0);
    __m256i acc[NB][M];
    ETMLX_UNROLL
    for (int c = 0; c < BLOCKS; ++c) {
      __m256i even[NB], odd[NB];  // the block's 32 low nibbles (even values) and 32 high ones (odd values)
      ETMLX_UNROLL
      for (int j = 0; j < NB; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j]));
        wb[j] += block_bytes;
        even[j] = _mm256_and_si256(b, nibble);
        odd[j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
      }
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi[r]));
        const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi[r] + 32));
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo[r]));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo[r] + 32));
        hi[r] += kIntBlock;
        lo[r] += kIntBlock;
        ETMLX_UNROLL
        for (int j = 0; j < NB; ++j) {
          const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(even[j], h0), _mm256_maddubs_epi16(odd[j], h1));
          __m256i sum = _mm256_madd_epi16(ph, high);
          if constexpr (INT16) {
            const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(even[j], l0), _mm256_maddubs_epi16(odd[j], l1));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pl, ones));
          }
          acc[j][r] = c == 0 ? sum : _mm256_add_epi32(acc[j][r], sum);
        }
      }
    }
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) {
      const float s = load_scale<T>(w.scales, static_cast<int64_t>(n + j) * groups + g);
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        total[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][r]), _mm256_set1_ps(s * steps[r][g]), total[j][r]);
      }
    }
  }
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j)
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) out[r * ldo + j] = avx2::hsum(total[j][r]);
}

template <int M, ScaleType T, bool INT16, int BLOCKS>
ETMLX_AVX2_TARGET void dot_avx2_int_blocks(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end,
                                    float* out, int64_t ldo) {
  int n = n_begin;
  if constexpr (M == 1) {  // two rows of W per pass, as the VNNI loop (each activation block loaded once for both)
    for (; n + 2 <= n_end; n += 2) dot_block_avx2_int<M, T, INT16, 2, BLOCKS>(w, rows, n, out + (n - n_begin), ldo);
  }
  for (; n < n_end; ++n) dot_block_avx2_int<M, T, INT16, 1, BLOCKS>(w, rows, n, out + (n - n_begin), ldo);
}

template <int M, ScaleType T, bool INT16>
void dot_avx2_int(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                  int64_t ldo) {
  if (w.group == kIntBlock) return dot_avx2_int_blocks<M, T, INT16, 1>(w, rows, n_begin, n_end, out, ldo);
  dot_avx2_int_blocks<M, T, INT16, 2>(w, rows, n_begin, n_end, out, ldo);  // integer rows: groups of 64 or 128
}

template <int BITS, ScaleType T>
ETMLX_AVX2_TARGET void dequantize_avx2(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    float* o = out + static_cast<int64_t>(n - n_begin) * w.k;
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const __m256 s = _mm256_set1_ps(load_scale<T>(w.scales, at)), b = _mm256_set1_ps(load_scale<T>(w.biases, at));
      for (int c = 0; c < chunks; ++c, wb += chunk_bytes, o += kChunk) {
        __m128i v[2];
        if constexpr (BITS == 4) {
          // Natural order: interleave the low (even values) and high (odd values) nibbles.
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
          const __m128i mask = _mm_set1_epi8(0x0f);
          const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
          v[0] = _mm_unpacklo_epi8(lo, hi), v[1] = _mm_unpackhi_epi8(lo, hi);
        } else {
          v[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
          v[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16));
        }
        ETMLX_UNROLL
        for (int h = 0; h < 2; ++h) {
          const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v[h]));
          const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v[h], v[h])));
          _mm256_storeu_ps(o + 16 * h, _mm256_fmadd_ps(q0, s, b));
          _mm256_storeu_ps(o + 16 * h + 8, _mm256_fmadd_ps(q1, s, b));
        }
      }
    }
  }
}

// ---- AVX-512: a chunk of 32 values is 2 vectors of 16 floats ----


template <int BITS>
ETMLX_AVX512 ETMLX_INLINE void chunk_avx512(const uint8_t* p, __m512* q) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
  } else {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

// NB consecutive rows of W against the M activation rows, CH chunks per group (0: w.group / kChunk at
// run time). Each (activation row, W row) pair is summed exactly as when NB is 1: two independent
// sums per group, one per vector of the chunk, for every row count (as in dot_avx2), so the bits
// do not depend on NB, M or where a row falls in the range.
template <int BITS, int M, ScaleType T, int NB, int CH>
ETMLX_AVX512 ETMLX_INLINE void dot_block_avx512(const QuantizedMatrix& w, const PreparedRows& rows, int n, float* out,
                                                int64_t ldo) {
  constexpr int NA = 2;
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = CH > 0 ? CH : w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  const uint8_t* wb[NB];
  __m512 total[NB][M];
  float bias_part[NB][M];
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j) {
    wb[j] = reinterpret_cast<const uint8_t*>(w.w) + (n + j) * row_bytes;
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) total[j][r] = _mm512_setzero_ps(), bias_part[j][r] = 0.0f;
  }
  const float* x = rows.x;
  for (int g = 0; g < groups; ++g) {
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wb[j]) + kPrefetchBytes, _MM_HINT_T0);
    __m512 acc[NB][M][NA];
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j)
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r)
        ETMLX_UNROLL
        for (int a = 0; a < NA; ++a) acc[j][r][a] = _mm512_setzero_ps();
    ETMLX_UNROLL
    for (int c = 0; c < chunks; ++c, x += kChunk) {
      // With one activation row, its chunk is loaded once for the NB rows of W.
      __m512 xv[M][2];
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r)
        ETMLX_UNROLL
        for (int i = 0; i < 2; ++i) xv[r][i] = _mm512_loadu_ps(x + static_cast<int64_t>(r) * w.k + 16 * i);
      ETMLX_UNROLL
      for (int j = 0; j < NB; ++j) {
        __m512 q[2];
        chunk_avx512<BITS>(wb[j], q);
        wb[j] += chunk_bytes;
        ETMLX_UNROLL
        for (int r = 0; r < M; ++r)
          ETMLX_UNROLL
          for (int i = 0; i < 2; ++i) acc[j][r][i] = _mm512_fmadd_ps(q[i], xv[r][i], acc[j][r][i]);
      }
    }
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) {
      const int64_t at = static_cast<int64_t>(n + j) * groups + g;
      const __m512 s = _mm512_set1_ps(load_scale<T>(w.scales, at));
      const float b = load_scale<T>(w.biases, at);
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        __m512 a = acc[j][r][0];
        ETMLX_UNROLL
        for (int i = 1; i < NA; ++i) a = _mm512_add_ps(a, acc[j][r][i]);
        total[j][r] = _mm512_fmadd_ps(a, s, total[j][r]);
        // Fused explicitly: the compiler contracted it before, and it must not depend on the block.
        bias_part[j][r] = __builtin_fmaf(b, rows.group_sums[static_cast<int64_t>(r) * groups + g], bias_part[j][r]);
      }
    }
  }
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j)
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) out[r * ldo + j] = _mm512_reduce_add_ps(total[j][r]) + bias_part[j][r];
}

template <int BITS, int M, ScaleType T, int CH>
ETMLX_AVX512 void dot_avx512_ch(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end,
                                float* out, int64_t ldo) {
  int n = n_begin;
  // One activation row (decode): two rows of W at once, each chunk of x loaded once for both and
  // their conversions and sums overlapping (in-cache 896 -> 4864: ~20% less time, same bits). Four
  // rows were as fast in cache but slower from memory (four interleaved streams).
  if constexpr (M == 1) {
    for (; n + 2 <= n_end; n += 2) dot_block_avx512<BITS, M, T, 2, CH>(w, rows, n, out + (n - n_begin), ldo);
  }
  for (; n < n_end; ++n) dot_block_avx512<BITS, M, T, 1, CH>(w, rows, n, out + (n - n_begin), ldo);
}

template <int BITS, int M, ScaleType T>
ETMLX_AVX512 void dot_avx512(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                             int64_t ldo) {
  switch (w.group / kChunk) {  // the usual group sizes with their chunk loop unrolled
    case 1: dot_avx512_ch<BITS, M, T, 1>(w, rows, n_begin, n_end, out, ldo); break;
    case 2: dot_avx512_ch<BITS, M, T, 2>(w, rows, n_begin, n_end, out, ldo); break;
    case 4: dot_avx512_ch<BITS, M, T, 4>(w, rows, n_begin, n_end, out, ldo); break;
    default: dot_avx512_ch<BITS, M, T, 0>(w, rows, n_begin, n_end, out, ldo); break;
  }
}

template <int BITS, ScaleType T>
ETMLX_AVX512 void dequantize_avx512(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    float* o = out + static_cast<int64_t>(n - n_begin) * w.k;
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const __m512 s = _mm512_set1_ps(load_scale<T>(w.scales, at)), b = _mm512_set1_ps(load_scale<T>(w.biases, at));
      for (int c = 0; c < chunks; ++c, wb += chunk_bytes, o += kChunk) {
        __m128i v[2];
        if constexpr (BITS == 4) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
          const __m128i mask = _mm_set1_epi8(0x0f);
          const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
          v[0] = _mm_unpacklo_epi8(lo, hi), v[1] = _mm_unpackhi_epi8(lo, hi);
        } else {
          v[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
          v[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16));
        }
        ETMLX_UNROLL
        for (int h = 0; h < 2; ++h) {
          _mm512_storeu_ps(o + 16 * h, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v[h])), s, b));
        }
      }
    }
  }
}

// ---- AVX-512 VNNI: integer activations (quantized_activations.h), a block of 64 values per vpdpbusd ----

// W's 64-value block as 64 unsigned bytes, in PreparedRows::hi's order: at 4 bits the 32 low nibbles
// (even values) then the 32 high ones, with no zero-extension to 32 bits as the float32 loop needs.
template <int BITS>
ETMLX_VNNI_TARGET ETMLX_INLINE __m512i block_vnni(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0f));
  } else {
    return _mm512_loadu_si512(p);
  }
}

// As dot_block_avx512 (NB rows of W against M activation rows), on integer activations: per group the
// integer sum q_w . q_x exactly in int32 lanes (int16: 256 * (q_w . hi) + q_w . lo), then one float32
// multiply-add by scale * step. BL blocks per group (0: at run time). The order of every operation is the
// same for any NB, M and range, so a row's bits depend only on that row and W.
template <int BITS, int M, ScaleType T, bool INT16, int NB, int BL>
ETMLX_VNNI_TARGET ETMLX_INLINE void dot_block_vnni(const QuantizedMatrix& w, const PreparedRows& rows, int n,
                                                   float* out, int64_t ldo) {
  constexpr int block_bytes = kIntBlock * BITS / 8;
  const int groups = w.k / w.group, blocks = BL > 0 ? BL : w.group / kIntBlock;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  const uint8_t* wb[NB];
  __m512 total[NB][M];
  float bias_part[NB][M];
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j) {
    wb[j] = reinterpret_cast<const uint8_t*>(w.w) + (n + j) * row_bytes;
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) total[j][r] = _mm512_setzero_ps(), bias_part[j][r] = 0.0f;
  }
  int64_t pos = 0;  // into each activation row's bytes
  for (int g = 0; g < groups; ++g) {
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wb[j]) + kPrefetchBytes, _MM_HINT_T0);
    __m512i acc_hi[NB][M], acc_lo[NB][M];
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j)
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) acc_hi[j][r] = acc_lo[j][r] = _mm512_setzero_si512();
    for (int c = 0; c < blocks; ++c, pos += kIntBlock) {
      __m512i vh[M], vl[M];
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        vh[r] = _mm512_loadu_si512(rows.hi + static_cast<int64_t>(r) * w.k + pos);
        if constexpr (INT16) vl[r] = _mm512_loadu_si512(rows.lo + static_cast<int64_t>(r) * w.k + pos);
      }
      ETMLX_UNROLL
      for (int j = 0; j < NB; ++j) {
        const __m512i wv = block_vnni<BITS>(wb[j]);
        wb[j] += block_bytes;
        ETMLX_UNROLL
        for (int r = 0; r < M; ++r) {
          acc_hi[j][r] = _mm512_dpbusd_epi32(acc_hi[j][r], wv, vh[r]);
          if constexpr (INT16) acc_lo[j][r] = _mm512_dpbusd_epi32(acc_lo[j][r], wv, vl[r]);
        }
      }
    }
    ETMLX_UNROLL
    for (int j = 0; j < NB; ++j) {
      const int64_t at = static_cast<int64_t>(n + j) * groups + g;
      const float s = load_scale<T>(w.scales, at), b = load_scale<T>(w.biases, at);
      const float centre = s * static_cast<float>(1 << (BITS - 1));  // see PreparedRows::residuals
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        // |256 * hi-sum + lo-sum| < 2^27 per lane even at 8 bits and group 128: no overflow.
        const __m512i a = INT16 ? _mm512_add_epi32(_mm512_slli_epi32(acc_hi[j][r], 8), acc_lo[j][r]) : acc_hi[j][r];
        const int64_t rg = static_cast<int64_t>(r) * groups + g;
        total[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s * rows.steps[rg]), total[j][r]);
        bias_part[j][r] = __builtin_fmaf(b, rows.group_sums[rg], bias_part[j][r]);
        bias_part[j][r] = __builtin_fmaf(centre, rows.residuals[rg], bias_part[j][r]);
      }
    }
  }
  ETMLX_UNROLL
  for (int j = 0; j < NB; ++j)
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) out[r * ldo + j] = _mm512_reduce_add_ps(total[j][r]) + bias_part[j][r];
}

template <int BITS, int M, ScaleType T, bool INT16, int BL>
ETMLX_VNNI_TARGET void dot_vnni_bl(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end,
                                   float* out, int64_t ldo) {
  int n = n_begin;
  if constexpr (M == 1) {  // two rows of W per pass, as the float32 loop (each x block loaded once for both)
    for (; n + 2 <= n_end; n += 2) dot_block_vnni<BITS, M, T, INT16, 2, BL>(w, rows, n, out + (n - n_begin), ldo);
  }
  for (; n < n_end; ++n) dot_block_vnni<BITS, M, T, INT16, 1, BL>(w, rows, n, out + (n - n_begin), ldo);
}

template <int BITS, int M, ScaleType T>
void dot_vnni(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out, int64_t ldo) {
  const bool int16 = rows.lo != nullptr;
  const int blocks = w.group / kIntBlock;
  if (int16) {
    if (blocks == 1) return dot_vnni_bl<BITS, M, T, true, 1>(w, rows, n_begin, n_end, out, ldo);
    if (blocks == 2) return dot_vnni_bl<BITS, M, T, true, 2>(w, rows, n_begin, n_end, out, ldo);
    return dot_vnni_bl<BITS, M, T, true, 0>(w, rows, n_begin, n_end, out, ldo);
  }
  if (blocks == 1) return dot_vnni_bl<BITS, M, T, false, 1>(w, rows, n_begin, n_end, out, ldo);
  if (blocks == 2) return dot_vnni_bl<BITS, M, T, false, 2>(w, rows, n_begin, n_end, out, ldo);
  dot_vnni_bl<BITS, M, T, false, 0>(w, rows, n_begin, n_end, out, ldo);
}

// A block's 64 bytes from natural order into PreparedRows::hi's: at 4 bits the even values, then the odd
// ones, which is vpmovwb of the block's bytes seen as 16-bit words, and of them >> 8.
ETMLX_VNNI_TARGET ETMLX_INLINE void place_block(const int8_t* natural, int bits, int8_t* out) {
  const __m512i z = _mm512_load_si512(natural);
  if (bits == 4) {
    const __m256i even = _mm512_cvtepi16_epi8(z), odd = _mm512_cvtepi16_epi8(_mm512_srli_epi16(z, 8));
    _mm512_storeu_si512(out, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
  } else {
    _mm512_storeu_si512(out, z);
  }
}

// prepare_integer_activations (quantized_rows.h): quantize_activation_group's integers and steps, 16 lanes at a
// time (quantized_activations_avx512.h).
ETMLX_VNNI_TARGET void prepare_integer_avx512(const float* x, int m, int k, int bits, int group,
                                              ActivationPrecision precision, int8_t* hi, int8_t* lo, float* steps,
                                              float* residuals, float* sums) {
  const int groups = k / group;
  const bool int16 = precision == ActivationPrecision::int16;
  const int qmax = int16 ? kInt16Max : kInt8Max;
  for (int r = 0; r < m; ++r) {
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(r) * groups + g, first = static_cast<int64_t>(r) * k + int64_t{g} * group;
      const float* xg = x + first;
      const avx512::GroupRounding rounding = avx512::group_rounding(xg, group, qmax);
      sums[at] = rounding.sum;
      steps[at] = rounding.step;
      if (rounding.zero) {  // as quantize_activation_group
        std::memset(hi + first, 0, group);
        if (int16) std::memset(lo + first, 0, group);
        residuals[at] = avx512::group_residual(rounding, _mm512_setzero_ps());
        continue;
      }
      __m512 residual = _mm512_setzero_ps();
      for (int b = 0; b < group; b += kIntBlock) {
        alignas(64) int8_t hb[kIntBlock], lb[kIntBlock];
        for (int i = 0; i < kIntBlock; i += 16) {
          const __m512i q = rounding.round(_mm512_loadu_ps(xg + b + i), residual);
          if (int16) {
            __m512i high, low;
            avx512::split_int16(q, high, low);
            _mm_store_si128(reinterpret_cast<__m128i*>(lb + i), _mm512_cvtepi32_epi8(low));
            _mm_store_si128(reinterpret_cast<__m128i*>(hb + i), _mm512_cvtepi32_epi8(high));
          } else {
            _mm_store_si128(reinterpret_cast<__m128i*>(hb + i), _mm512_cvtepi32_epi8(q));
          }
        }
        place_block(hb, bits, hi + first + b);
        if (int16) place_block(lb, bits, lo + first + b);
      }
      residuals[at] = avx512::group_residual(rounding, residual);
    }
  }
}

// ---- AVX2: prepare_integer_activations 8 lanes at a time ----
//
// quantize_activation_group's integers and steps (the same float32 multiply by qmax / max|x|, rounding to
// nearest even, clamp), the group's sum and residual summed in 8 float32 lanes, then reduced (the portable
// loop sums them in double: both are within the loops' stated bounds).

// 32 int32 values (q[0] holds values 0-7, ..., q[3] 24-31, each in [-128, 127]) as 32 bytes in order.
ETMLX_AVX2_INLINE __m256i narrow32(const __m256i q[4]) {
  // packs work within 128-bit lanes: bytes come out as [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | the 4-7s]; the word
  // permute restores the order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A block's 64 bytes (v0: values 0-31, v1: 32-63) in PreparedRows::hi's order at 4 bits: the even values, then
// the odd ones.
ETMLX_AVX2_INLINE void place_block_avx2(__m256i v0, __m256i v1, int8_t* out) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  // Per vector: [evens of its 32 values (16 bytes) | odds (16 bytes)].
  const __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v0, split), 0xD8);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v1, split), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(a, b, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(a, b, 0x31));
}

ETMLX_AVX2_TARGET void prepare_integer_avx2_impl(const float* x, int m, int k, int bits, int group,
                                          ActivationPrecision precision, int8_t* hi, int8_t* lo, float* steps,
                                          float* residuals, float* sums) {
  const int groups = k / group;
  const bool int16 = precision == ActivationPrecision::int16;
  const int qmax = int16 ? kInt16Max : kInt8Max;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i top = _mm256_set1_epi32(qmax), bottom = _mm256_set1_epi32(-qmax);
  for (int r = 0; r < m; ++r) {
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(r) * groups + g, first = static_cast<int64_t>(r) * k + int64_t{g} * group;
      const float* xg = x + first;
      __m256 largest = _mm256_setzero_ps(), sum = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int i = 0; i < group; i += 8) {
        const __m256 v = _mm256_loadu_ps(xg + i);
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v));
        sum = _mm256_add_ps(sum, v);
        const __m256 d = _mm256_sub_ps(v, v);  // NaN for inf and NaN
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
      }
      sums[at] = avx2::hsum(sum);
      const float most = avx2::hmax(largest);
      if (_mm256_movemask_ps(bad) != 0 || most == 0.0f) {  // as quantize_activation_group
        std::memset(hi + first, 0, group);
        if (int16) std::memset(lo + first, 0, group);
        steps[at] = residuals[at] = most == 0.0f && _mm256_movemask_ps(bad) == 0 ? 0.0f : std::nanf("");
        continue;
      }
      const float step = most / static_cast<float>(qmax);
      const __m256 inverse = _mm256_set1_ps(static_cast<float>(qmax) / most), vstep = _mm256_set1_ps(step);
      __m256 residual = _mm256_setzero_ps();
      for (int b = 0; b < group; b += kIntBlock) {
        __m256i high[2], low[2];
        for (int half = 0; half < 2; ++half) {
          __m256i qh[4], ql[4];
          for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_loadu_ps(xg + b + 32 * half + 8 * j);
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse));  // MXCSR's round to nearest even
            q = _mm256_max_epi32(_mm256_min_epi32(q, top), bottom);
            residual = _mm256_add_ps(residual, _mm256_fnmadd_ps(vstep, _mm256_cvtepi32_ps(q), v));
            if (int16) {  // q = 256 * hi + lo, lo the signed low byte
              ql[j] = _mm256_srai_epi32(_mm256_slli_epi32(q, 24), 24);
              qh[j] = _mm256_srai_epi32(_mm256_sub_epi32(q, ql[j]), 8);
            } else {
              qh[j] = q;
            }
          }
          high[half] = narrow32(qh);
          if (int16) low[half] = narrow32(ql);
        }
        if (bits == 4) {
          place_block_avx2(high[0], high[1], hi + first + b);
          if (int16) place_block_avx2(low[0], low[1], lo + first + b);
        } else {
          for (int half = 0; half < 2; ++half) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + first + b + 32 * half), high[half]);
            if (int16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + first + b + 32 * half), low[half]);
          }
        }
      }
      steps[at] = step;
      residuals[at] = avx2::hsum(residual);
    }
  }
}

// ---- dispatch (plain functions: the templates above carry the targets) ----

void dot_avx2_any(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                  int64_t ldo) {
  dispatch_rows(w.bits, rows.m, w.scale_type, [&]<int B, int M, ScaleType T>() {
    if constexpr (B == 4) {  // integer rows exist only at 4 bits (rows_precision; RowsVariant::integer_max_bits)
      if (rows.hi != nullptr) {
        if (rows.lo != nullptr) return dot_avx2_int<M, T, true>(w, rows, n_begin, n_end, out, ldo);
        return dot_avx2_int<M, T, false>(w, rows, n_begin, n_end, out, ldo);
      }
    }
    dot_avx2<B, M, T>(w, rows, n_begin, n_end, out, ldo);
  });
}

void dequantize_avx2_any(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  dispatch_dequantize(w.bits, w.scale_type, [&]<int B, ScaleType T>() { dequantize_avx2<B, T>(w, n_begin, n_end, out); });
}

void dot_avx512_any(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                    int64_t ldo) {
  dispatch_rows(w.bits, rows.m, w.scale_type, [&]<int B, int M, ScaleType T>() {
    if (rows.hi != nullptr) {
      dot_vnni<B, M, T>(w, rows, n_begin, n_end, out, ldo);
    } else {
      dot_avx512<B, M, T>(w, rows, n_begin, n_end, out, ldo);
    }
  });
}

void dequantize_avx512_any(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  dispatch_dequantize(w.bits, w.scale_type,
                      [&]<int B, ScaleType T>() { dequantize_avx512<B, T>(w, n_begin, n_end, out); });
}

}  // namespace

void prepare_integer_avx2(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                          int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums) {
  prepare_integer_avx2_impl(x, m, k, bits, group, precision, hi, lo, steps, residuals, sums);
}

const RowsVariant* avx2_rows() {
  // Integer activation rows at 4 bits (vpmaddubsw: dot_block_avx2_int), prepared 8 lanes at a time.
  static const RowsVariant v{"avx2", dot_avx2_any, dequantize_avx2_any, true, prepare_integer_avx2_impl, 4};
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok ? &v : nullptr;
}

const RowsVariant* avx512_rows() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                         __builtin_cpu_supports("fma");
  // Integer activation rows where the CPU has VNNI (and BW, for the byte ops).
  static const bool vnni = ok && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  static const RowsVariant v{"avx512", dot_avx512_any, dequantize_avx512_any, vnni,
                             vnni ? prepare_integer_avx512 : nullptr};
  return ok ? &v : nullptr;
}

}  // namespace etmlx::kernels

#else  // not x86-64

namespace etmlx::kernels {
void prepare_integer_avx2(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                          int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums) {
  prepare_integer_portable(x, m, k, bits, group, precision, hi, lo, steps, residuals, sums);
}
const RowsVariant* avx2_rows() { return nullptr; }
const RowsVariant* avx512_rows() { return nullptr; }
}  // namespace etmlx::kernels

#endif
