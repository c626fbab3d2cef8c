// attention_cpu.h: attention's softmax with an AVX-512 (or AVX2) exp, and a decode step's attention as one loop
// (functions with their own target attribute; other CPUs take MLX's ops).
#include "kernels/attention_cpu.h"

#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <mlx/ops.h>

#include "kernels/attention.h"
#include "kernels/host_kernel.h"
#include "kernels/thread_pool.h"
#include "options.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// From this many query rows (a prefill) attention takes the host-loop softmax between two MLX matmuls;
// fewer (a decode step) one host loop for the whole attention (sdpa_decode_cpu).
constexpr int kMinQueryRows = 16;

// ETMLX_BLAS=reference is the batch-invariant mode (docs/cpu-kernels.md): a request's bits must not depend on
// the call it shares, but the call's width (set by the longest prompt in it) picks this path or MLX's, whose
// softmaxes round differently. That mode keeps MLX's attention at every width.
bool batch_invariant() { return options::process().blas_reference; }

}  // namespace

}  // namespace etmlx::kernels

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see quantized_rows_x86.cpp)
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, in _mm512_reduce_*_ps
#endif

#include <immintrin.h>

#include "kernels/avx2_vectors.h"
#include "kernels/exp_vectors.h"

namespace etmlx::kernels {

namespace {

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

MaskView mask_view(const mx::array& m) {
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

View4 view4(const mx::array& a) {
  return View4{a.data<float>(), {a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]}};
}

// Row `p` (n values, stride `stride`) as contiguous floats: itself, or copied into `tmp`.
const float* dense(const float* p, int64_t stride, int n, float* tmp) {
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
ETMLX_AVX512BW void scores_blocked(const float* q, const float* k0, int64_t key_stride, int keys, int dim,
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

// out[d] = sum over keys j of p[j] * value j [d] (value j at v0 + j * value_stride, contiguous), 64 values of d
// per pass over the keys. Even and odd keys go to two sets of accumulators: one set is a chain of dependent
// multiply-adds, one a key, whose latency (not the multiply-adds' throughput) set the pace. A key's
// parity, not the key count, picks its set, so a row's result does not depend on how many keys follow it.
ETMLX_AVX512BW void weighted_values(const float* p, const float* v0, int64_t value_stride, int keys, int dim_v,
                                    float* out) {
  for (int d0 = 0; d0 < dim_v; d0 += 64) {
    const int width = std::min(64, dim_v - d0), vectors = (width + 15) / 16;
    __mmask16 m[4];
    __m512 even[4], odd[4];
    for (int a = 0; a < 4; ++a) {
      m[a] = first_lanes(std::max(0, width - a * 16));
      even[a] = odd[a] = _mm512_setzero_ps();
    }
    const float* vr = v0 + d0;
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
    for (int a = 0; a < vectors; ++a) _mm512_mask_storeu_ps(out + d0 + a * 16, m[a], _mm512_add_ps(even[a], odd[a]));
  }
}

// Attention for a few query rows (a decode step) as one host loop: per query row, its scores against
// keys [0, keys) of its key/value head, the softmax above (scale, mask, causality), then the weighted sum
// of the values, in float32 with fmas. Replaces ~19 MLX nodes per layer (the scale multiply, the
// reshapes and broadcasts of q, k, v and the mask, two OpenBLAS products, select, softmax).
struct DecodeAttention {
  int heads, group, rows_l, keys, dim, dim_v;
  Softmax softmax;

  ETMLX_AVX512BW void row(const View4& q, const View4& k, const View4& v, float* out, int64_t r,
                          std::vector<float>& scratch) const {
    const int64_t b = r / (int64_t{heads} * rows_l), h = (r / rows_l) % heads, l = r % rows_l, kvh = h / group;
    scratch.resize(static_cast<size_t>(keys) + 2 * std::max(dim, dim_v));
    float* scores = scratch.data();
    float* tmp = scores + keys;
    const float* qr = dense(q.at(b, h, l), q.s[3], dim, tmp + std::max(dim, dim_v));
    const float* k0 = k.at(b, kvh, 0);
    if (k.s[3] == 1 && dim % 16 == 0 && dim <= kBlockedDim) {
      scores_blocked(qr, k0, k.s[2], keys, dim, scores);
    } else {
      for (int j = 0; j < keys; ++j) scores[j] = dot(qr, dense(k0 + j * k.s[2], k.s[3], dim, tmp), dim);
    }
    softmax.row(scores, r);
    const float* v0 = v.at(b, kvh, 0);
    if (v.s[3] == 1) {
      weighted_values(scores, v0, v.s[2], keys, dim_v, out + r * dim_v);
      return;
    }
    __m512 acc[8];
    for (int d0 = 0; d0 < dim_v; d0 += 128) {  // 8 accumulators of 16 lanes per pass over the keys
      const int width = std::min(128, dim_v - d0);
      for (int a = 0; a < 8; ++a) acc[a] = _mm512_setzero_ps();
      for (int j = 0; j < keys; ++j) {
        const float* vr = dense(v0 + j * v.s[2] + d0 * v.s[3], v.s[3], width, tmp);
        const __m512 p = _mm512_set1_ps(scores[j]);
        for (int a = 0; a * 16 < width; ++a) {
          acc[a] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(first_lanes(width - a * 16), vr + a * 16), acc[a]);
        }
      }
      for (int a = 0; a * 16 < width; ++a) {
        _mm512_mask_storeu_ps(out + r * dim_v + d0 + a * 16, first_lanes(width - a * 16), acc[a]);
      }
    }
  }
};

// The decode loop 8 lanes at a time (AVX2+FMA): a key's score is q . key by 8-lane multiply-adds and one
// horizontal sum (it depends only on q and that key), the weighted values summed key after key (a masked key's
// probability is 0 and adds nothing), 64 values of d per pass over the keys.
ETMLX_AVX2_INLINE float dot_avx2(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < n; d += 8) {
    const __m256i m = avx2::first_lanes(n - d);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + d, m), _mm256_maskload_ps(b + d, m), acc);
  }
  return avx2::hsum(acc);
}

// The scores of N (a multiple of 4) keys stored contiguously from k on (a unit last stride, dim a multiple of
// 8): N independent multiply-add chains where dot_avx2's one chain waits on each multiply-add (a key's dim / 8
// of them back to back), and one reduction per four keys. Each score is dot_avx2's bit for bit: the same lanes,
// summed in the same order (avx2::hsum4).
template <int N>
ETMLX_AVX2_INLINE void score_keys(const float* q, const float* k, int64_t key_stride, int dim, float* scores) {
  __m256 a[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) a[i] = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i * key_stride + d), a[i]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < N; i += 4) _mm_storeu_ps(scores + i, avx2::hsum4(a[i], a[i + 1], a[i + 2], a[i + 3]));
}

ETMLX_AVX2_TARGET void scores_avx2(const float* q, const float* k0, int64_t key_stride, int keys, int dim,
                                   float* scores) {
  int j = 0;
  // Eight chains: a multiply-add's latency times its two pipes.
  for (; j + 8 <= keys; j += 8) score_keys<8>(q, k0 + j * key_stride, key_stride, dim, scores + j);
  for (; j + 4 <= keys; j += 4) score_keys<4>(q, k0 + j * key_stride, key_stride, dim, scores + j);
  for (; j < keys; ++j) scores[j] = dot_avx2(q, k0 + j * key_stride, dim);
}

// 64 output values of sum_j p[j] * v_j, v_j = v0 + j * stride contiguous: the generic loop below with its
// eight accumulators named, so that they stay in registers (with an array and a data-dependent vector count
// GCC kept them on the stack, a store and a load on every multiply-add's chain: ~3x slower at 512 keys).
// The same multiply-adds in the same order, so the same bits.
ETMLX_AVX2_TARGET void weighted_values64_avx2(const float* p, const float* v0, int64_t stride, int keys, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int j = 0; j < keys; ++j) {
    const float* vr = v0 + j * stride;
    const __m256 w = _mm256_set1_ps(p[j]);
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 32), a4);
    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 40), a5);
    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 48), a6);
    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 56), a7);
  }
  _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1), _mm256_storeu_ps(out + 16, a2);
  _mm256_storeu_ps(out + 24, a3), _mm256_storeu_ps(out + 32, a4), _mm256_storeu_ps(out + 40, a5);
  _mm256_storeu_ps(out + 48, a6), _mm256_storeu_ps(out + 56, a7);
}

ETMLX_AVX2_TARGET void decode_row_avx2(const DecodeAttention& att, const View4& q, const View4& k, const View4& v, float* out,
                                int64_t r, std::vector<float>& scratch) {
  const int keys = att.keys, dim = att.dim, dim_v = att.dim_v;
  const int64_t b = r / (int64_t{att.heads} * att.rows_l), h = (r / att.rows_l) % att.heads, l = r % att.rows_l;
  const int64_t kvh = h / att.group;
  scratch.resize(static_cast<size_t>(keys) + 2 * std::max(dim, dim_v));
  float* scores = scratch.data();
  float* tmp = scores + keys;
  const float* qr = dense(q.at(b, h, l), q.s[3], dim, tmp + std::max(dim, dim_v));
  const float* k0 = k.at(b, kvh, 0);
  if (k.s[3] == 1 && dim % 8 == 0) {
    scores_avx2(qr, k0, k.s[2], keys, dim, scores);
  } else {
    for (int j = 0; j < keys; ++j) scores[j] = dot_avx2(qr, dense(k0 + j * k.s[2], k.s[3], dim, tmp), dim);
  }
  att.softmax.row_avx2(scores, r);
  const float* v0 = v.at(b, kvh, 0);
  float* o = out + r * dim_v;
  for (int d0 = 0; d0 < dim_v; d0 += 64) {
    const int width = std::min(64, dim_v - d0), vectors = (width + 7) / 8;
    if (width == 64 && v.s[3] == 1) {
      weighted_values64_avx2(scores, v0 + d0, v.s[2], keys, o + d0);
      continue;
    }
    __m256i m[8];
    __m256 acc[8];
    for (int a = 0; a < 8; ++a) m[a] = avx2::first_lanes(std::max(0, width - 8 * a)), acc[a] = _mm256_setzero_ps();
    for (int j = 0; j < keys; ++j) {
      const float* vr = dense(v0 + j * v.s[2] + d0 * v.s[3], v.s[3], width, tmp);
      const __m256 p = _mm256_set1_ps(scores[j]);
#pragma GCC unroll 8
      for (int a = 0; a < 8; ++a) {
        if (a >= vectors) break;
        acc[a] = _mm256_fmadd_ps(p, _mm256_maskload_ps(vr + 8 * a, m[a]), acc[a]);
      }
    }
    for (int a = 0; a < vectors; ++a) _mm256_maskstore_ps(o + d0 + 8 * a, m[a], acc[a]);
  }
}

// The mask's strides against [B, H, L, S] (0 where it broadcasts), from the array as materialised.
MaskView strided_mask_view(const mx::array& m) {
  MaskView v;
  v.boolean = m.dtype() == mx::bool_;
  int64_t st[4] = {0, 0, 0, 0};
  const int lead = 4 - static_cast<int>(m.ndim());
  for (int i = 0; i < static_cast<int>(m.ndim()); ++i) st[lead + i] = m.shape(i) == 1 ? 0 : m.strides()[i];
  v.sb = st[0], v.sh = st[1], v.sl = st[2], v.ss = st[3];
  v.data = v.boolean ? static_cast<const void*>(m.data<bool>()) : static_cast<const void*>(m.data<float>());
  return v;
}

// The decode loop's node: the result, and with `view` its transposed (by view->first) and reshaped (to
// view->second) copies as two more outputs.
std::vector<mx::array> sdpa_decode_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                       bool causal, const std::optional<mx::array>& mask, int key_end,
                                       const std::pair<std::vector<int>, mx::Shape>* view) {
  const int batch = q.shape(0), heads = q.shape(1), rows_l = q.shape(2);
  const int keys = std::min(key_end, static_cast<int>(k.shape(2)));
  DecodeAttention att{heads, heads / static_cast<int>(k.shape(1)), rows_l, keys, static_cast<int>(q.shape(3)),
                      static_cast<int>(v.shape(3)), Softmax{heads, rows_l, keys, causal ? keys - rows_l : -1, scale, {}}};
  std::vector<mx::array> inputs{q, k, v};
  if (mask) inputs.push_back(*mask);
  const mx::Shape out_shape{batch, heads, rows_l, static_cast<int>(v.shape(3))};
  std::vector<mx::Shape> shapes{out_shape};
  std::vector<int> perm;
  if (view) {
    perm = view->first;
    mx::Shape t;
    for (int p : perm) t.push_back(out_shape[p]);
    shapes.push_back(std::move(t));
    shapes.push_back(view->second);
  }
  const bool wide = exp16_supported();  // else AVX2 (decode_loop_applies)
  auto loop = [att, perm, wide](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    mx::array& out = outs[0];
    DecodeAttention a = att;
    const View4 qv = view4(in[0]), kv = view4(in[1]), vv = view4(in[2]);
    std::vector<float> mask_row;
    if (in.size() > 3) a.softmax.mask = strided_mask_view(in[3]);
    // Softmax::row reads a mask row's values contiguously (or one value for the row): any other
    // last-axis stride is gathered per row below.
    const bool gather_mask = in.size() > 3 && a.softmax.mask.ss != 0 && a.softmax.mask.ss != 1;
    float* o = out.data<float>();
    const int64_t rows = int64_t{a.softmax.heads} * a.rows_l * in[0].shape(0);
    auto range = [&](int r0, int r1) {
      std::vector<float> scratch;
      std::vector<uint8_t> mask_bytes;
      std::vector<float> mask_vals;
      for (int64_t r = r0; r < r1; ++r) {
        if (!gather_mask) {
          wide ? a.row(qv, kv, vv, o, r, scratch) : decode_row_avx2(a, qv, kv, vv, o, r, scratch);
          continue;
        }
        DecodeAttention g = a;
        const MaskView& m = a.softmax.mask;
        const int64_t b = r / (int64_t{a.heads} * a.rows_l), h = (r / a.rows_l) % a.heads, l = r % a.rows_l;
        const int64_t at = b * m.sb + h * m.sh + l * m.sl;
        if (m.boolean) {
          mask_bytes.resize(a.keys);
          for (int j = 0; j < a.keys; ++j) mask_bytes[j] = static_cast<const uint8_t*>(m.data)[at + j * m.ss];
          g.softmax.mask.data = mask_bytes.data() - at;
        } else {
          mask_vals.resize(a.keys);
          for (int j = 0; j < a.keys; ++j) mask_vals[j] = static_cast<const float*>(m.data)[at + j * m.ss];
          g.softmax.mask.data = mask_vals.data() - at;
        }
        g.softmax.mask.ss = 1;
        wide ? g.row(qv, kv, vv, o, r, scratch) : decode_row_avx2(g, qv, kv, vv, o, r, scratch);
      }
    };
    const int64_t work = int64_t{a.keys} * (a.dim + a.dim_v);
    parallel_for(static_cast<int>(rows), static_cast<int>(std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, work))),
                 range);
    if (outs.size() == 3) {
      transpose_copy(o, out.shape(), perm, outs[1].data<float>());
      std::copy(outs[1].data<float>(), outs[1].data<float>() + outs[1].size(), outs[2].data<float>());
    }
  };
  return host_kernel_multi("AttentionDecodeCpu", std::move(shapes), mx::float32, std::move(inputs), loop);
}

// sdpa_cpu's decode loop applies (float32 throughout, an AVX-512 or AVX2+FMA CPU, not the batch-invariant mode).
bool decode_loop_applies(const mx::array& q, const mx::array& k, const mx::array& v,
                         const std::optional<mx::array>& mask, int key_end) {
  return q.dtype() == mx::float32 && (exp16_supported() || exp8_supported()) && !batch_invariant() && q.shape(2) < kMinQueryRows &&
         k.dtype() == mx::float32 && v.dtype() == mx::float32 && key_end >= 1 &&
         (!mask || mask->dtype() == mx::bool_ || mask->dtype() == mx::float32);
}

}  // namespace


namespace {

// A row Softmax::row would answer differently from MLX's softmax (a NaN or +inf in it, or every value -inf, where
// Softmax::row gives zeros for attention's fully masked rows) goes through exp(x - max) / sum in scalar float32,
// in place, so that its NaNs come out as MLX's op and PyTorch give them. False: the row is left to Softmax::row.
bool softmax_by_formula(float* row, int n) {
  bool finite_max = false, special = false;
  for (int j = 0; j < n; ++j) {
    const float v = row[j];
    special |= std::isnan(v) || v == std::numeric_limits<float>::infinity();
    finite_max |= v != -std::numeric_limits<float>::infinity();
  }
  if (finite_max && !special) return false;
  float most = row[0];
  for (int j = 1; j < n; ++j) most = std::isnan(most) || std::isnan(row[j]) ? std::nanf("") : std::max(most, row[j]);
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - most));
  for (int j = 0; j < n; ++j) row[j] /= sum;
  return true;
}

// Every [keys] row of `scores` (row-contiguous) through `s` into `out` (which may be scores' own buffer), rows on
// the pool; with `by_formula`, the rows softmax_by_formula takes go through it instead.
void softmax_rows(const Softmax& s, const mx::array& scores, mx::array& out, bool wide, bool by_formula) {
  const float* src = scores.data<float>();
  float* dst = out.data<float>();
  const int64_t rows = static_cast<int64_t>(scores.size()) / s.keys;
  auto range = [&](int r0, int r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = dst + r * s.keys;
      if (row != src + r * s.keys) std::copy(src + r * s.keys, src + (r + 1) * s.keys, row);
      if (by_formula && softmax_by_formula(row, s.keys)) continue;
      wide ? s.row(row, r) : s.row_avx2(row, r);
    }
  };
  parallel_for(static_cast<int>(rows), std::max<int>(1, 4096 / std::max(1, s.keys)), range);
}

}  // namespace

mx::array sdpa_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                   const std::optional<mx::array>& mask_in, int key_end) {
  const int batch = q.shape(0), heads = q.shape(1), rows_l = q.shape(2), dim = q.shape(3);
  const int kv_heads = k.shape(1), dim_v = v.shape(3);
  if (rows_l < kMinQueryRows) {
    // A decode step: one host loop instead of MLX's ~19 nodes (a mask in another dtype than bool was
    // already cast to q's by the caller).
    if (decode_loop_applies(q, k, v, mask_in, key_end)) return sdpa_decode_cpu(q, k, v, scale, causal, mask_in, key_end, nullptr)[0];
    return sdpa(q, k, v, scale, causal, mask_in, key_end);
  }
  if (q.dtype() != mx::float32 || !(exp16_supported() || exp8_supported()) || batch_invariant()) {
    return sdpa(q, k, v, scale, causal, mask_in, key_end);
  }
  mx::array kk = k, vv = v;
  std::optional<mx::array> mask = mask_in;
  keep_first_keys(kk, vv, mask, key_end);  // as sdpa(): only keys [0, key_end)
  const int keys = kk.shape(2);
  const int group = heads / kv_heads;
  // Each query head against its key/value head by broadcasting (no copy of k or v per query head); every
  // product is [L, D] x [D, S] for one head, small enough for one OpenBLAS thread (blas_route.cpp).
  const mx::array qg = mx::reshape(q, {batch, kv_heads, group, rows_l, dim});
  const mx::array scores = mx::matmul(qg, mx::expand_dims(mx::swapaxes(kk, 2, 3), 2));  // [B, Hkv, G, L, S]
  std::vector<mx::array> inputs{mx::contiguous(scores)};
  if (mask) inputs.push_back(mx::contiguous(*mask));
  Softmax sm{heads, rows_l, keys, causal ? keys - rows_l : -1, scale, {}};
  if (mask) sm.mask = mask_view(*mask);
  const bool wide = exp16_supported();  // else AVX2's 8 lanes
  auto loop = [sm, wide](const std::vector<mx::array>& in, mx::array& out) {
    Softmax s = sm;
    if (in.size() > 1) s.mask.data = in[1].data<void>();
    softmax_rows(s, in[0], out, wide, /*by_formula=*/false);
  };
  const mx::array probs = host_kernel("AttentionSoftmaxCpu", scores.shape(), mx::float32, std::move(inputs), loop,
                                      /*may_reuse_input0=*/true);
  const mx::array out = mx::matmul(probs, mx::expand_dims(vv, 2));  // [B, Hkv, G, L, Dv]
  return mx::reshape(out, {batch, heads, rows_l, dim_v});
}


std::optional<mx::array> softmax_last_axis_cpu(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() == 0 || x.size() == 0 || !(exp16_supported() || exp8_supported()) || batch_invariant()) {
    return std::nullopt;
  }
  const int keys = x.shape(-1);
  const Softmax sm{1, 1, keys, -1, 1.0f, {}};  // each row on its own: r / (heads * rows_l) = r, no mask
  const bool wide = exp16_supported();
  auto loop = [sm, wide](const std::vector<mx::array>& in, mx::array& out) {
    softmax_rows(sm, in[0], out, wide, /*by_formula=*/true);
  };
  return host_kernel("SoftmaxCpu", x.shape(), mx::float32, {contiguous_operand(x)}, loop, /*may_reuse_input0=*/true);
}

std::vector<mx::array> sdpa_decode_viewed_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                              bool causal, const std::optional<mx::array>& mask, int key_end,
                                              const std::vector<int>& perm, const mx::Shape& shape) {
  if (q.ndim() != 4 || !decode_loop_applies(q, k, v, mask, key_end)) return {};
  const std::pair<std::vector<int>, mx::Shape> view{perm, shape};
  return sdpa_decode_cpu(q, k, v, scale, causal, mask, key_end, &view);
}

}  // namespace etmlx::kernels

#else  // not x86-64: MLX's ops

namespace etmlx::kernels {

mx::array sdpa_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                   const std::optional<mx::array>& mask, int key_end) {
  return sdpa(q, k, v, scale, causal, mask, key_end);
}

std::optional<mx::array> softmax_last_axis_cpu(const mx::array&) { return std::nullopt; }

std::vector<mx::array> sdpa_decode_viewed_cpu(const mx::array&, const mx::array&, const mx::array&, float, bool,
                                              const std::optional<mx::array>&, int, const std::vector<int>&,
                                              const mx::Shape&) {
  return {};
}

}  // namespace etmlx::kernels

#endif
