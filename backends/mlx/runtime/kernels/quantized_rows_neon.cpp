// quantized_rows.h on arm64: the NEON variant (every arm64 CPU has NEON, so no run-time check).
#include "kernels/quantized_rows_variants.h"

#if defined(__aarch64__)

#include <arm_neon.h>

namespace etmlx::kernels {

namespace {

// 16 bytes as 16 floats in order, 4 vectors of 4.
inline void widen16(uint8x16_t b, float32x4_t* q) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
  q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  q[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
  q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  q[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
}

// The chunk's 32 integers in prepared order (quantized_rows.h), 8 vectors of 4.
template <int BITS>
inline void chunk_neon(const uint8_t* p, float32x4_t* q) {
  if constexpr (BITS == 4) {
    const uint8x16_t b = vld1q_u8(p);
    widen16(vandq_u8(b, vdupq_n_u8(0x0f)), q);
    widen16(vshrq_n_u8(b, 4), q + 4);
  } else {
    widen16(vld1q_u8(p), q);
    widen16(vld1q_u8(p + 16), q + 4);
  }
}

template <int BITS, int M, ScaleType T>
void dot_neon(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out, int64_t ldo) {
  constexpr int NA = 2;  // independent sums per row, the same for every row count (see the AVX2 variant)
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    float32x4_t total[M];
    float bias_part[M];
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) total[r] = vdupq_n_f32(0.0f), bias_part[r] = 0.0f;
    const float* x = rows.x;
    for (int g = 0; g < groups; ++g) {
      float32x4_t acc[M][NA];
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r)
        ETMLX_UNROLL
        for (int a = 0; a < NA; ++a) acc[r][a] = vdupq_n_f32(0.0f);
      for (int c = 0; c < chunks; ++c, wb += chunk_bytes, x += kChunk) {
        float32x4_t q[8];
        chunk_neon<BITS>(wb, q);
        ETMLX_UNROLL
        for (int r = 0; r < M; ++r) {
          const float* xr = x + static_cast<int64_t>(r) * w.k;
          ETMLX_UNROLL
          for (int i = 0; i < 8; ++i) acc[r][i % NA] = vfmaq_f32(acc[r][i % NA], q[i], vld1q_f32(xr + 4 * i));
        }
      }
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const float s = load_scale<T>(w.scales, at), b = load_scale<T>(w.biases, at);
      ETMLX_UNROLL
      for (int r = 0; r < M; ++r) {
        float32x4_t a = acc[r][0];
        ETMLX_UNROLL
        for (int i = 1; i < NA; ++i) a = vaddq_f32(a, acc[r][i]);
        total[r] = vfmaq_n_f32(total[r], a, s);
        bias_part[r] += b * rows.group_sums[static_cast<int64_t>(r) * groups + g];
      }
    }
    ETMLX_UNROLL
    for (int r = 0; r < M; ++r) out[r * ldo + (n - n_begin)] = vaddvq_f32(total[r]) + bias_part[r];
  }
}

template <int BITS, ScaleType T>
void dequantize_neon(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  constexpr int chunk_bytes = kChunk * BITS / 8;
  const int groups = w.k / w.group, chunks = w.group / kChunk;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  for (int n = n_begin; n < n_end; ++n) {
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.w) + n * row_bytes;
    float* o = out + static_cast<int64_t>(n - n_begin) * w.k;
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n) * groups + g;
      const float32x4_t s = vdupq_n_f32(load_scale<T>(w.scales, at)), b = vdupq_n_f32(load_scale<T>(w.biases, at));
      for (int c = 0; c < chunks; ++c, wb += chunk_bytes, o += kChunk) {
        uint8x16_t v[2];
        if constexpr (BITS == 4) {
          // Natural order: zip the low (even values) and high (odd values) nibbles.
          const uint8x16_t bytes = vld1q_u8(wb);
          const uint8x16x2_t z = vzipq_u8(vandq_u8(bytes, vdupq_n_u8(0x0f)), vshrq_n_u8(bytes, 4));
          v[0] = z.val[0], v[1] = z.val[1];
        } else {
          v[0] = vld1q_u8(wb), v[1] = vld1q_u8(wb + 16);
        }
        ETMLX_UNROLL
        for (int h = 0; h < 2; ++h) {
          float32x4_t q[4];
          widen16(v[h], q);
          ETMLX_UNROLL
          for (int i = 0; i < 4; ++i) vst1q_f32(o + 16 * h + 4 * i, vfmaq_f32(b, q[i], s));
        }
      }
    }
  }
}

void dot_neon_any(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                  int64_t ldo) {
  dispatch_rows(w.bits, rows.m, w.scale_type, [&]<int B, int M, ScaleType T>() {
    dot_neon<B, M, T>(w, rows, n_begin, n_end, out, ldo);
  });
}

void dequantize_neon_any(const QuantizedMatrix& w, int n_begin, int n_end, float* out) {
  dispatch_dequantize(w.bits, w.scale_type, [&]<int B, ScaleType T>() { dequantize_neon<B, T>(w, n_begin, n_end, out); });
}

}  // namespace

const RowsVariant* neon_rows() {
  static const RowsVariant v{"neon", dot_neon_any, dequantize_neon_any};
  return &v;
}

}  // namespace etmlx::kernels

#else  // not arm64

namespace etmlx::kernels {
const RowsVariant* neon_rows() { return nullptr; }
}  // namespace etmlx::kernels

#endif
