// attention_quantized_cpu.h: a decode step's attention over a packed KV cache, dequantized 64 keys at a time.
#include "kernels/attention_quantized_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <algorithm>
#include <cstdint>
#include <vector>

#include <mlx/ops.h>

#include "kernels/attention_rows.h"
#include "kernels/host_kernel.h"
#include "kernels/thread_pool.h"
#include "options.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

using namespace attention_rows;  // Softmax, mask_view, scores_blocked, weighted_values_chunk

// Keys dequantized at a time: 32 KB of float32 at head size 128. Even, so that the weighted values' key pairs
// (weighted_values_chunk) fall as in one pass over all keys.
constexpr int kBlockKeys = 64;

// One packed cache operand [B, Hkv, S, W] as evaluated: its bytes (or floats) and the strides of its first three
// axes (the last is 1: the operands are row-contiguous, host_kernel.h).
template <typename T>
struct Rows {
  const T* data;
  int64_t sb, sh, ss;
  const T* at(int64_t b, int64_t h, int64_t j) const { return data + b * sb + h * sh + j * ss; }
};

template <typename T>
Rows<T> rows_of(const mx::array& a) {
  return Rows<T>{a.data<T>(), a.strides()[0], a.strides()[1], a.strides()[2]};
}

// A scales or biases operand [B, Hkv, S, G] in float32, bfloat16 or float16 (--kv-scale-dtype: a float32 program's
// cache keeps them in bfloat16 by default), read one group's value at a time as float32 (exactly: every value of
// the narrower types is a float32).
struct ScaleRows {
  const void* data;
  int64_t sb, sh, ss;
  mx::Dtype dtype;
  float at(int64_t b, int64_t h, int64_t j, int g) const {
    const int64_t i = b * sb + h * sh + j * ss + g;
    if (dtype == mx::bfloat16) return static_cast<float>(static_cast<const mx::bfloat16_t*>(data)[i]);
    if (dtype == mx::float16) return static_cast<float>(static_cast<const mx::float16_t*>(data)[i]);
    return static_cast<const float*>(data)[i];
  }
};

ScaleRows scale_rows_of(const mx::array& a) {
  return ScaleRows{a.data<void>(), a.strides()[0], a.strides()[1], a.strides()[2], a.dtype()};
}

// One side of the cache (keys or values): the packed integers with their scales and biases.
struct Packed {
  Rows<uint8_t> words;
  ScaleRows scales, biases;
};

// 16 integers of a packed row from column c on (c a multiple of 16) as float32.
ETMLX_AVX512BW ETMLX_INLINE __m512 unpack16(const uint8_t* row, int c, int bits) {
  if (bits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
  // 4 bits: eight bytes, element 2i in byte i's low nibble and 2i + 1 in its high one; interleaving the low and
  // high nibbles puts the 16 elements in order.
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low4), _mm_and_si128(_mm_srli_epi16(x, 4), low4));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// Keys [j0, j0 + n) of head (b, h), columns [c0, c0 + width) (multiples of 16), as float32 rows of `width` in
// `out`: scale * q + bias with two roundings, as mx::dequantize computes it (explicit rounding modes, so that
// the compiler cannot fuse them into one multiply-add).
ETMLX_AVX512BW void dequantize_block(const Packed& p, int64_t b, int64_t h, int j0, int n, int c0, int width,
                                     int group, int bits, float* out) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int i = 0; i < n; ++i) {
    const uint8_t* w = p.words.at(b, h, j0 + i);
    float* o = out + static_cast<int64_t>(i) * width;
    int g = -1;
    __m512 scale = _mm512_setzero_ps(), bias = _mm512_setzero_ps();
    for (int c = c0; c < c0 + width; c += 16) {
      if (c / group != g) {  // 16 columns never straddle a group (groups of 32, 64 or 128)
        g = c / group;
        scale = _mm512_set1_ps(p.scales.at(b, h, j0 + i, g));
        bias = _mm512_set1_ps(p.biases.at(b, h, j0 + i, g));
      }
      const __m512 x = _mm512_mul_round_ps(unpack16(w, c, bits), scale, kRound);
      _mm512_storeu_ps(o + (c - c0), _mm512_add_round_ps(x, bias, kRound));
    }
  }
}

struct QuantizedDecode {
  int batch, heads, kv_heads, rows_l, keys, dim, dim_v, group, bits;
  Softmax softmax;

  int repeats() const { return heads / kv_heads; }
  // The global row index (as Softmax and the output count rows, [B, H, L]) of row m of head (b, kvh)'s rows.
  int64_t row(int64_t b, int64_t kvh, int m) const {
    const int64_t h = kvh * repeats() + m / rows_l;
    return (b * heads + h) * rows_l + m % rows_l;
  }
};

// Phase 1: scores[r][j] = q_r . key j, for the keys of one block and every query row of its key/value head.
ETMLX_AVX512BW void score_block(const QuantizedDecode& a, const View4& q, const Packed& k, int64_t b, int64_t kvh,
                                int j0, float* key_buf, float* q_buf, float* scores) {
  const int n = std::min(kBlockKeys, a.keys - j0);
  dequantize_block(k, b, kvh, j0, n, 0, a.dim, a.group, a.bits, key_buf);
  for (int m = 0; m < a.repeats() * a.rows_l; ++m) {
    const int64_t r = a.row(b, kvh, m);
    const int64_t h = r / a.rows_l % a.heads, l = r % a.rows_l;
    const float* qr = dense(q.at(b, h, l), q.s[3], a.dim, q_buf);
    float* s = scores + r * a.keys + j0;
    if (a.dim % 16 == 0 && a.dim <= kBlockedDim) {  // as DecodeAttention::row on contiguous keys
      scores_blocked(qr, key_buf, a.dim, n, a.dim, s);
    } else {
      for (int j = 0; j < n; ++j) s[j] = dot(qr, key_buf + static_cast<int64_t>(j) * a.dim, a.dim);
    }
  }
}

// Phase 3: out[r][c0, c0 + 64) = sum over keys of p_r[j] * value j, for every query row of one key/value head;
// each row's accumulators carried from block to block (weighted_values' bits).
ETMLX_AVX512BW void weigh_values(const QuantizedDecode& a, const Packed& v, int64_t b, int64_t kvh, int c0,
                                 const float* probs, float* value_buf, std::vector<float>& state, float* out) {
  const int width = std::min(64, a.dim_v - c0), rows = a.repeats() * a.rows_l;
  state.assign(static_cast<size_t>(rows) * 128, 0.0f);  // per row: 4 even then 4 odd vectors of 16
  for (int j0 = 0; j0 < a.keys; j0 += kBlockKeys) {
    const int n = std::min(kBlockKeys, a.keys - j0);
    dequantize_block(v, b, kvh, j0, n, c0, width, a.group, a.bits, value_buf);
    for (int m = 0; m < rows; ++m) {
      float* st = state.data() + static_cast<int64_t>(m) * 128;
      __m512 even[4], odd[4];
      for (int i = 0; i < 4; ++i) even[i] = _mm512_loadu_ps(st + 16 * i), odd[i] = _mm512_loadu_ps(st + 64 + 16 * i);
      weighted_values_chunk(probs + a.row(b, kvh, m) * a.keys + j0, value_buf, width, n, width, even, odd);
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(st + 16 * i, even[i]), _mm512_storeu_ps(st + 64 + 16 * i, odd[i]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    const float* st = state.data() + static_cast<int64_t>(m) * 128;
    float* o = out + a.row(b, kvh, m) * a.dim_v + c0;
    for (int i = 0; i * 16 < width; ++i) {
      const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(st + 16 * i), _mm512_loadu_ps(st + 64 + 16 * i));
      _mm512_mask_storeu_ps(o + 16 * i, first_lanes(width - 16 * i), sum);
    }
  }
}

void run(QuantizedDecode a, const std::vector<mx::array>& in, mx::array& out) {
  const View4 qv = view4(in[0]);
  const Packed k{rows_of<uint8_t>(in[1]), scale_rows_of(in[2]), scale_rows_of(in[3])};
  const Packed v{rows_of<uint8_t>(in[4]), scale_rows_of(in[5]), scale_rows_of(in[6])};
  if (in.size() > 7) a.softmax.mask.data = in[7].data<void>();
  const int64_t rows = int64_t{a.batch} * a.heads * a.rows_l;
  std::vector<float> scores(static_cast<size_t>(rows) * a.keys);
  const int blocks = (a.keys + kBlockKeys - 1) / kBlockKeys, heads = a.batch * a.kv_heads;
  auto score_range = [&](int u0, int u1) {
    std::vector<float> key_buf(static_cast<size_t>(kBlockKeys) * a.dim), q_buf(a.dim);
    for (int u = u0; u < u1; ++u) {
      score_block(a, qv, k, u / blocks / a.kv_heads, u / blocks % a.kv_heads, u % blocks * kBlockKeys,
                  key_buf.data(), q_buf.data(), scores.data());
    }
  };
  parallel_for(heads * blocks, 1, score_range);
  auto softmax_range = [&](int r0, int r1) {
    for (int64_t r = r0; r < r1; ++r) a.softmax.row(scores.data() + r * a.keys, r);
  };
  parallel_for(static_cast<int>(rows), std::max<int>(1, 4096 / a.keys), softmax_range);
  const int chunks = (a.dim_v + 63) / 64;
  float* o = out.data<float>();
  auto value_range = [&](int u0, int u1) {
    std::vector<float> value_buf(static_cast<size_t>(kBlockKeys) * 64), state;
    for (int u = u0; u < u1; ++u) {
      weigh_values(a, v, u / chunks / a.kv_heads, u / chunks % a.kv_heads, u % chunks * 64, scores.data(),
                   value_buf.data(), state, o);
    }
  };
  parallel_for(heads * chunks, 1, value_range);
}

// Each of the mask's dims is 1 or the scores' [B, H, L, keys] (so that mask_view reads it in place).
bool mask_fits(const mx::array& m, const mx::Shape& scores) {
  if (m.ndim() > 4 || (m.dtype() != mx::bool_ && m.dtype() != mx::float32)) return false;
  for (int i = 0; i < static_cast<int>(m.ndim()); ++i) {
    const int d = m.shape(i), want = scores[4 - m.ndim() + i];
    if (d != 1 && d != want) return false;
  }
  return true;
}

}  // namespace

std::optional<mx::array> sdpa_quantized_decode_cpu(const mx::array& q, const std::vector<mx::array>& cache, float scale,
                                                   const std::optional<mx::array>& mask, int key_end, int group_size,
                                                   int bits) {
  if (!exp16_supported() || options::process().blas_reference || q.ndim() != 4 || q.dtype() != mx::float32) {
    return std::nullopt;
  }
  if (cache.size() != 6 || (bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128)) {
    return std::nullopt;
  }
  const int batch = q.shape(0), heads = q.shape(1), rows_l = q.shape(2), dim = q.shape(3);
  const int kv_heads = cache[0].shape(1), cache_len = cache[0].shape(2);
  const int dim_v = cache[3].shape(3) * 8 / bits;
  const int keys = std::min(key_end, cache_len);
  if (keys < 1 || kv_heads < 1 || heads % kv_heads != 0 || dim % group_size != 0 || dim_v % group_size != 0) {
    return std::nullopt;
  }
  const mx::Dtype scales = cache[1].dtype();
  if (scales != mx::float32 && scales != mx::bfloat16 && scales != mx::float16) return std::nullopt;
  for (int i = 0; i < 6; ++i) {
    if (cache[i].dtype() != (i % 3 == 0 ? mx::uint8 : scales)) return std::nullopt;
  }
  const mx::Shape out_shape{batch, heads, rows_l, dim_v};
  const mx::Shape score_shape{batch, heads, rows_l, keys};
  if (mask && !mask_fits(*mask, score_shape)) return std::nullopt;
  QuantizedDecode a{batch, heads, kv_heads, rows_l, keys, dim, dim_v, group_size, bits,
                    Softmax{heads, rows_l, keys, -1, scale, {}}};
  std::vector<mx::array> inputs{contiguous_operand(q)};
  for (const mx::array& c : cache) inputs.push_back(contiguous_operand(c));
  if (mask) {
    a.softmax.mask = mask_view(*mask);
    inputs.push_back(contiguous_operand(*mask));
  }
  auto loop = [a](const std::vector<mx::array>& in, mx::array& out) { run(a, in, out); };
  return host_kernel("AttentionQuantizedDecodeCpu", out_shape, mx::float32, std::move(inputs), loop);
}

}  // namespace etmlx::kernels

#else  // not x86-64: MLX's ops

namespace etmlx::kernels {

std::optional<mlx::core::array> sdpa_quantized_decode_cpu(const mlx::core::array&,
                                                          const std::vector<mlx::core::array>&, float,
                                                          const std::optional<mlx::core::array>&, int, int, int) {
  return std::nullopt;
}

}  // namespace etmlx::kernels

#endif
