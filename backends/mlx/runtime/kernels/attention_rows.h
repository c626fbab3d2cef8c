// The row loops of the CPU set's attention, x86-64 only: the score-row softmax (scale, mask, causality; AVX-512
// or AVX2), a query row's scores against contiguous keys and its weighted sum of contiguous values (AVX-512).
// Shared by the float cache's kernels (attention_cpu.cpp) and the quantized cache's decode loop
// (attention_quantized_cpu.cpp), so that both give the same bits for the same keys and values.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see quantized_rows_x86.cpp)
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, in _mm512_reduce_*_ps
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include <mlx/array.h>

#include "kernels/avx2_vectors.h"
#include "kernels/exp_vectors.h"

namespace etmlx::kernels::attention_rows {

namespace mx = mlx::core;

#define ETMLX_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define ETMLX_INLINE inline __attribute__((always_inline))

// The mask of a vector's first n lanes (all 16 from n = 16 on): for the last, partial vector of a row.
ETMLX_INLINE __mmask16 first_lanes(int n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

// exp16 / exp8: kernels/exp_vectors.h.

// ---- AVX2+FMA (a CPU without AVX-512): the decode loop 8 lanes at a time ----

// How a [B, H, L, S] score row finds its mask entries: the mask as given (up to 4-d, each dim 1 or the
// scores'), its strides 0 where it broadcasts.
struct MaskView {
  const void* data = nullptr;
  bool boolean = false;
  int64_t sb = 0, sh = 0, sl = 0, ss = 0;
};

struct Softmax {
  int heads, rows_l, keys, causal_offset;  // causal: row l sees keys j <= l + causal_offset; < 0: no causality
  float scale;
  MaskView mask;

  // One score row [keys] to probabilities, in place: x = s * scale (+ mask), masked keys -inf, then
  // exp(x - max) / sum. A row with every key masked gives zeros (MLX's op: NaN).
  ETMLX_AVX512BW void row(float* s, int64_t r) const {
    const int64_t b = r / (int64_t{heads} * rows_l), h = (r / rows_l) % heads, l = r % rows_l;
    const int seen = causal_offset < 0 ? keys : static_cast<int>(std::clamp<int64_t>(l + causal_offset + 1, 0, keys));
    const int64_t at = b * mask.sb + h * mask.sh + l * mask.sl;
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 vmax = ninf;
    for (int j = 0; j < seen; j += 16) {
      const __mmask16 m = first_lanes(seen - j);
      __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), vscale);
      if (mask.data != nullptr) {
        if (mask.ss == 0) {  // one mask value for the whole row
          if (mask.boolean) {
            if (!static_cast<const uint8_t*>(mask.data)[at]) x = ninf;
          } else {
            x = _mm512_add_ps(x, _mm512_set1_ps(static_cast<const float*>(mask.data)[at]));
          }
        } else if (mask.boolean) {
          const __m128i bytes = _mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(mask.data) + at + j);
          x = _mm512_mask_mov_ps(ninf, _mm_test_epi8_mask(bytes, bytes), x);
        } else {
          x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, static_cast<const float*>(mask.data) + at + j));
        }
      }
      _mm512_mask_storeu_ps(s + j, m, x);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
    }
    const float mx_ = _mm512_reduce_max_ps(vmax);
    if (mx_ == -std::numeric_limits<float>::infinity()) {
      std::fill(s, s + keys, 0.0f);
      return;
    }
    const __m512 shift = _mm512_set1_ps(mx_);
    __m512 vsum = _mm512_setzero_ps();
    for (int j = 0; j < seen; j += 16) {
      const __mmask16 m = first_lanes(seen - j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), shift));
      _mm512_mask_storeu_ps(s + j, m, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int j = 0; j < seen; j += 16) {
      const __mmask16 m = first_lanes(seen - j);
      _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
    }
    std::fill(s + seen, s + keys, 0.0f);
  }

  // row() 8 lanes at a time (an AVX2 CPU: prefill's softmax and the decode loop's). Whole vectors use plain
  // loads and stores and only a row's last, partial vector the masked ones: on AMD's Zen a masked 256-bit store
  // is microcoded (several cycles each), and three passes of them were ~half of the row's time.
  ETMLX_AVX2_TARGET void row_avx2(float* s, int64_t r) const {
    const int64_t b = r / (int64_t{heads} * rows_l), h = (r / rows_l) % heads, l = r % rows_l;
    const int seen = causal_offset < 0 ? keys : static_cast<int>(std::clamp<int64_t>(l + causal_offset + 1, 0, keys));
    const int64_t at = b * mask.sb + h * mask.sh + l * mask.sl;
    const float ninf_s = -std::numeric_limits<float>::infinity();
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(ninf_s);
    const int whole = seen & ~7, rest = seen - whole;
    const __m256i tail = avx2::first_lanes(rest);
    // Scores times the scale plus the mask at keys j..j+n (n <= 8; lanes past n are the loaded zeros).
    auto scaled = [&](int j, int n, __m256 x) ETMLX_AVX2_TARGET {
      x = _mm256_mul_ps(x, vscale);
      if (mask.data == nullptr) return x;
      if (mask.ss == 0) {  // one mask value for the whole row
        if (mask.boolean) return static_cast<const uint8_t*>(mask.data)[at] ? x : ninf;
        return _mm256_add_ps(x, _mm256_set1_ps(static_cast<const float*>(mask.data)[at]));
      }
      if (mask.boolean) {
        const uint8_t* src = static_cast<const uint8_t*>(mask.data) + at + j;
        int64_t word = 0;
        std::memcpy(&word, src, n);  // n is the literal 8 in the whole-vector loop, where this is inlined
        const __m256i flags = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
        return _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(flags, _mm256_setzero_si256())));
      }
      const float* add = static_cast<const float*>(mask.data) + at + j;
      return _mm256_add_ps(x, n == 8 ? _mm256_loadu_ps(add) : _mm256_maskload_ps(add, avx2::first_lanes(n)));
    };
    __m256 vmax = ninf;
    for (int j = 0; j < whole; j += 8) {
      const __m256 x = scaled(j, 8, _mm256_loadu_ps(s + j));
      _mm256_storeu_ps(s + j, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    if (rest) {
      __m256 x = scaled(whole, rest, _mm256_maskload_ps(s + whole, tail));
      x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(tail));  // lanes past the row: -inf for the max
      _mm256_maskstore_ps(s + whole, tail, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    const float mx_ = avx2::hmax(vmax);
    if (mx_ == ninf_s) {
      std::fill(s, s + keys, 0.0f);
      return;
    }
    const __m256 shift = _mm256_set1_ps(mx_);
    __m256 vsum = _mm256_setzero_ps();
    for (int j = 0; j < whole; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
      _mm256_storeu_ps(s + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    if (rest) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + whole, tail), shift)),
                                     _mm256_castsi256_ps(tail));
      _mm256_maskstore_ps(s + whole, tail, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / avx2::hsum(vsum));
    for (int j = 0; j < whole; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
    if (rest) _mm256_maskstore_ps(s + whole, tail, _mm256_mul_ps(_mm256_maskload_ps(s + whole, tail), inv));
    std::fill(s + seen, s + keys, 0.0f);
  }
};

inline MaskView mask_view(const mx::array& m) {
  MaskView v;
  v.boolean = m.dtype() == mx::bool_;
  int dims[4] = {1, 1, 1, 1};
  for (int i = 0; i < static_cast<int>(m.ndim()); ++i) dims[4 - m.ndim() + i] = m.shape(i);
  const int64_t ss = 1, sl = dims[3], sh = sl * dims[2], sb = sh * dims[1];
  v.ss = dims[3] == 1 ? 0 : ss;
  v.sl = dims[2] == 1 ? 0 : sl;
  v.sh = dims[1] == 1 ? 0 : sh;
  v.sb = dims[0] == 1 ? 0 : sb;
  return v;
}

// A [B, H, L, D]-style operand read in place, any strides (the loop gets it as MLX materialised it: a
// Contiguous node per operand would cost more than the few strided reads of a decode step).
struct View4 {
  const float* data;
  int64_t s[4];
  const float* at(int64_t b, int64_t h, int64_t l) const { return data + b * s[0] + h * s[1] + l * s[2]; }
};

inline View4 view4(const mx::array& a) {
  return View4{a.data<float>(), {a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]}};
}

// Row `p` (n values, stride `stride`) as contiguous floats: itself, or copied into `tmp`.
inline const float* dense(const float* p, int64_t stride, int n, float* tmp) {
  if (stride == 1) return p;
  for (int i = 0; i < n; ++i) tmp[i] = p[i * stride];
  return tmp;
}

ETMLX_AVX512BW ETMLX_INLINE float dot(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int d = 0; d < n; d += 16) {
    const __mmask16 m = first_lanes(n - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Lane i of the result: the sum of p[i]'s 16 lanes, for 16 vectors at once (a transpose as it adds:
// 45 shuffles and adds where 16 separate horizontal sums take ~3x that). Every lane's sum is added in the
// same order, (((0+2)+(1+3)) per quarter, then (q0+q1)+(q2+q3)), so it depends only on p[i], not on i.
ETMLX_AVX512BW ETMLX_INLINE __m512 sums16(__m512 p[16]) {
  __m512 q[8], r[4];
  for (int i = 0; i < 8; ++i)  // per quarter [a0+a2, b0+b2, a1+a3, b1+b3] of p[2i] = a, p[2i+1] = b
    q[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per quarter the quarter sums of p[4i] .. p[4i + 3]
    const __m512d x = _mm512_castps_pd(q[2 * i]), y = _mm512_castps_pd(q[2 * i + 1]);
    r[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x88), _mm512_shuffle_f32x4(r[2], r[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// scores[j] = q . key j for j < keys (key j at k0 + j * key_stride, contiguous; dim a multiple of 16 up to
// kBlockedDim), 16 keys at a time through sums16. A key's score depends only on q and that key.
constexpr int kBlockedDim = 128;
ETMLX_AVX512BW inline void scores_blocked(const float* q, const float* k0, int64_t key_stride, int keys, int dim,
                                   float* scores) {
  const int chunks = dim / 16;
  __m512 qv[kBlockedDim / 16];
  for (int c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < keys; j += 16) {
    const int n = std::min(16, keys - j);
    __m512 p[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {  // past the last key: zeros, which leave the other lanes' sums as they are
        p[i] = _mm512_setzero_ps();
        continue;
      }
      const float* kr = k0 + (j + i) * key_stride;
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
      p[i] = acc;
    }
    _mm512_mask_storeu_ps(scores + j, first_lanes(n), sums16(p));
  }
}

// The multiply-adds of weighted_values for one chunk of `width` (<= 64) values of d from vr on (value j at
// vr + j * value_stride), keys [0, keys) added to `even` / `odd` (4 vectors each): pairs (j, j + 1) from j = 0,
// the even key to `even`, the odd to `odd`, a last unpaired key to `even`. A caller that splits the keys into
// runs of even length and carries the accumulators gets the same bits as one call over all of them.
ETMLX_AVX512BW ETMLX_INLINE void weighted_values_chunk(const float* p, const float* vr, int64_t value_stride, int keys,
                                                       int width, __m512 even[4], __m512 odd[4]) {
  const int vectors = (width + 15) / 16;
  __mmask16 m[4];
  for (int a = 0; a < 4; ++a) m[a] = first_lanes(std::max(0, width - a * 16));
  int j = 0;
  for (; j + 2 <= keys; j += 2, vr += 2 * value_stride) {
    const __m512 pe = _mm512_set1_ps(p[j]), po = _mm512_set1_ps(p[j + 1]);
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) {
      if (a >= vectors) break;
      even[a] = _mm512_fmadd_ps(pe, _mm512_maskz_loadu_ps(m[a], vr + a * 16), even[a]);
      odd[a] = _mm512_fmadd_ps(po, _mm512_maskz_loadu_ps(m[a], vr + value_stride + a * 16), odd[a]);
    }
  }
  if (j < keys) {
    const __m512 pe = _mm512_set1_ps(p[j]);
    for (int a = 0; a < vectors; ++a) even[a] = _mm512_fmadd_ps(pe, _mm512_maskz_loadu_ps(m[a], vr + a * 16), even[a]);
  }
}

// out[d] = sum over keys j of p[j] * value j [d] (value j at v0 + j * value_stride, contiguous), 64 values of d
// per pass over the keys. Even and odd keys go to two sets of accumulators: one set is a chain of dependent
// multiply-adds, one a key, whose latency (not the multiply-adds' throughput) set the pace. A key's
// parity, not the key count, picks its set, so a row's result does not depend on how many keys follow it.
ETMLX_AVX512BW inline void weighted_values(const float* p, const float* v0, int64_t value_stride, int keys, int dim_v,
                                           float* out) {
  for (int d0 = 0; d0 < dim_v; d0 += 64) {
    const int width = std::min(64, dim_v - d0);
    __m512 even[4], odd[4];
    for (int a = 0; a < 4; ++a) even[a] = odd[a] = _mm512_setzero_ps();
    weighted_values_chunk(p, v0 + d0, value_stride, keys, width, even, odd);
    for (int a = 0; a * 16 < width; ++a) {
      _mm512_mask_storeu_ps(out + d0 + a * 16, first_lanes(width - a * 16), _mm512_add_ps(even[a], odd[a]));
    }
  }
}

}  // namespace etmlx::kernels::attention_rows

#endif
