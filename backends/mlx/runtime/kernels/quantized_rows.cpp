// quantized_rows.h: the shared pieces, the portable scalar variant, and the choice of variant.
#include "kernels/quantized_rows.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "kernels/quantized_rows_variants.h"
#include "options.h"

namespace etmlx::kernels {

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: exactly man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&u, &v, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float scale_to_float(const void* base, ScaleType type, int64_t index) {
  switch (type) {
    case ScaleType::f32: return load_scale<ScaleType::f32>(base, index);
    case ScaleType::f16: return load_scale<ScaleType::f16>(base, index);
    case ScaleType::bf16: return load_scale<ScaleType::bf16>(base, index);
  }
  return 0.0f;
}

void prepare_activations(const float* x, int m, int k, int bits, int group, float* xp, float* sums) {
  const int groups = k / group;
  for (int r = 0; r < m; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * k;
    float* pr = xp + static_cast<int64_t>(r) * k;
    if (bits == 4) {
      // Chunk of 32 values: byte i holds values 2i (low nibble) and 2i + 1 (high nibble).
      for (int c = 0; c < k; c += kChunk) {
        for (int i = 0; i < kChunk / 2; ++i) {
          pr[c + i] = xr[c + 2 * i];
          pr[c + kChunk / 2 + i] = xr[c + 2 * i + 1];
        }
      }
    } else {
      std::memcpy(pr, xr, sizeof(float) * k);
    }
    for (int g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int i = 0; i < group; ++i) s += xr[g * group + i];
      sums[static_cast<int64_t>(r) * groups + g] = s;
    }
  }
}

namespace {
const RowsVariant& chosen();  // below: the variant in use
}  // namespace

ActivationPrecision rows_precision(int bits, int group, ActivationPrecision wanted) {
  if (wanted == ActivationPrecision::float32 || (bits != 4 && bits != 8) || group % kIntBlock != 0) {
    return ActivationPrecision::float32;
  }
  return chosen().integer_rows && bits <= chosen().integer_max_bits ? wanted : ActivationPrecision::float32;
}

void PreparedActivations::prepare(const float* x, int m, int k, int bits, int group, ActivationPrecision wanted) {
  k_ = k, groups_ = k / group;
  precision_ = rows_precision(bits, group, wanted);
  sums_.resize(static_cast<size_t>(m) * groups_);
  if (precision_ == ActivationPrecision::float32) {
    xp_.resize(static_cast<size_t>(m) * k);
    prepare_activations(x, m, k, bits, group, xp_.data(), sums_.data());
    return;
  }
  hi_.resize(static_cast<size_t>(m) * k);
  lo_.resize(precision_ == ActivationPrecision::int16 ? static_cast<size_t>(m) * k : 0);
  steps_.resize(static_cast<size_t>(m) * groups_);
  residuals_.resize(steps_.size());
  prepare_integer_activations(x, m, k, bits, group, precision_, hi_.data(), lo_.empty() ? nullptr : lo_.data(),
                              steps_.data(), residuals_.data(), sums_.data());
}

void prepare_integer_activations(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                                 int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums) {
  // Only a variant with integer rows makes them, and each such variant prepares them in its own instructions.
  chosen().prepare_integer(x, m, k, bits, group, precision, hi, lo, steps, residuals, sums);
}

void prepare_integer_portable(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                              int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums) {
  const int groups = k / group;
  const bool int16 = precision == ActivationPrecision::int16;
  std::vector<int8_t> qh(group), ql(group);
  for (int r = 0; r < m; ++r) {
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(r) * groups + g, first = static_cast<int64_t>(r) * k + int64_t{g} * group;
      const float* xg = x + first;
      const float step = quantize_activation_group(xg, group, precision, qh.data(), int16 ? ql.data() : nullptr);
      steps[at] = step;
      // The group's sum, and what the rounding left (x_i - step * q_i), summed in double: PreparedRows.
      double sum = 0.0, residual = 0.0;
      for (int i = 0; i < group; ++i) {
        const int q = int16 ? 256 * qh[i] + ql[i] : qh[i];
        sum += xg[i];
        residual += static_cast<double>(xg[i]) - static_cast<double>(step) * q;
      }
      sums[at] = static_cast<float>(sum);
      residuals[at] = step > 0.0f ? static_cast<float>(residual) : (step == 0.0f ? 0.0f : step);
      // Per block of 64: at 4 bits the even values, then the odd ones (the order the loops read W in).
      for (int b = 0; b < group; b += kIntBlock) {
        for (int i = 0; i < kIntBlock; ++i) {
          const int from = bits == 4 ? (i < kIntBlock / 2 ? 2 * i : 2 * (i - kIntBlock / 2) + 1) : i;
          hi[first + b + i] = qh[b + from];
          if (int16) lo[first + b + i] = ql[b + from];
        }
      }
    }
  }
}

PreparedRows PreparedActivations::rows(int first, int count) const {
  PreparedRows rows{nullptr, sums_.data() + static_cast<size_t>(first) * groups_, count};
  if (precision_ == ActivationPrecision::float32) {
    rows.x = xp_.data() + static_cast<size_t>(first) * k_;
  } else {
    rows.hi = hi_.data() + static_cast<size_t>(first) * k_;
    rows.lo = lo_.empty() ? nullptr : lo_.data() + static_cast<size_t>(first) * k_;
    rows.steps = steps_.data() + static_cast<size_t>(first) * groups_;
    rows.residuals = residuals_.data() + static_cast<size_t>(first) * groups_;
  }
  return rows;
}

namespace {

// The value of chunk byte position `i` in prepared order (see prepare_activations).
template <int BITS>
inline void chunk_values(const uint8_t* bytes, float* q) {
  if constexpr (BITS == 4) {
    for (int i = 0; i < kChunk / 2; ++i) {
      q[i] = static_cast<float>(bytes[i] & 0xf);
      q[kChunk / 2 + i] = static_cast<float>(bytes[i] >> 4);
    }
  } else {
    for (int i = 0; i < kChunk; ++i) q[i] = static_cast<float>(bytes[i]);
  }
}

template <int BITS, int M, ScaleType T>
void dot_scalar(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out, int64_t ldo) {
  const int groups = w.k / w.group, row_bytes = w.k * BITS / 8;
  constexpr int chunk_bytes = kChunk * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + static_cast<int64_t>(n) * row_bytes;
    float total[M] = {};
    for (int g = 0; g < groups; ++g) {
      float dot[M] = {};
      for (int c = g * w.group; c < (g + 1) * w.group; c += kChunk) {
        float q[kChunk];
        chunk_values<BITS>(wb + c / kChunk * chunk_bytes, q);
        for (int r = 0; r < M; ++r) {
          const float* xr = rows.x + static_cast<int64_t>(r) * w.k + c;
          for (int i = 0; i < kChunk; ++i) dot[r] += xr[i] * q[i];
        }
      }
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const float s = load_scale<T>(w.scales, at), b = load_scale<T>(w.biases, at);
      for (int r = 0; r < M; ++r) total[r] += s * dot[r] + b * rows.group_sums[static_cast<int64_t>(r) * groups + g];
    }
    for (int r = 0; r < M; ++r) out[r * ldo + (n - n_begin)] = total[r];
  }
}

template <int BITS, ScaleType T>
void dequantize_scalar(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  const int groups = w.k / w.group, row_bytes = w.k * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + static_cast<int64_t>(n) * row_bytes;
    float* o = out + static_cast<int64_t>(n - n_begin) * w.k;
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const float s = load_scale<T>(w.scales, at), b = load_scale<T>(w.biases, at);
      for (int i = g * w.group; i < (g + 1) * w.group; ++i) {
        const int q = BITS == 4 ? (wb[i / 2] >> (4 * (i & 1))) & 0xf : wb[i];
        o[i] = s * static_cast<float>(q) + b;
      }
    }
  }
}

void dot_scalar_any(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                    int64_t ldo) {
  dispatch_rows(w.bits, rows.m, w.scale_type, [&]<int B, int M, ScaleType T>() {
    dot_scalar<B, M, T>(w, rows, n_begin, n_end, out, ldo);
  });
}

void dequantize_scalar_any(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  dispatch_dequantize(w.bits, w.scale_type, [&]<int B, ScaleType T>() { dequantize_scalar<B, T>(w, n_begin, n_end, out); });
}

const RowsVariant& chosen() {
  static const RowsVariant* v = [] {
    const std::string& forced = options::process().qmm_isa;  // ETMLX_QMM_ISA
    const RowsVariant* best = avx512_rows();
    if (!best) best = avx2_rows();
    if (!best) best = neon_rows();
    if (!best) best = &scalar_rows();
    if (forced.empty()) return best;
    for (const RowsVariant* c : {avx512_rows(), avx2_rows(), neon_rows(), &scalar_rows()}) {
      if (c != nullptr && forced == c->name) return c;
    }
    std::fprintf(stderr, "etmlx: ETMLX_QMM_ISA=%s: this CPU has no such loop; using %s\n", forced.c_str(), best->name);
    return best;
  }();
  return *v;
}

}  // namespace

const RowsVariant& scalar_rows() {
  static const RowsVariant v{"scalar", dot_scalar_any, dequantize_scalar_any};
  return v;
}

void quantized_dot_rows(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                        int64_t ldo) {
  chosen().dot(w, rows, n_begin, n_end, out, ldo);
}

void dequantize_rows(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  chosen().dequantize(w, n_begin, n_end, out);
}

const char* quantized_rows_isa() { return chosen().name; }

}  // namespace etmlx::kernels
