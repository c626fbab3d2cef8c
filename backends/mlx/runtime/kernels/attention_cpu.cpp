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

#include "kernels/attention_rows.h"

namespace etmlx::kernels {

namespace {

using namespace attention_rows;  // Softmax, the masks' views, the score and weighted-value loops

// Attention for a few query rows (a decode step) as one host loop: per query row, its scores against
// keys [0, keys) of its key/value head, Softmax::row (scale, mask, causality), then the weighted sum
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
