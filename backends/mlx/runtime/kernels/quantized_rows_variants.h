// What each instruction-set file of quantized_rows.h provides, and what they share.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/quantized_rows.h"

// Fully unrolls a loop with a compile-time trip count (rows, accumulators, vectors of a chunk): the
// vector accumulators then live in registers; GCC at -O2 would otherwise keep the arrays on the stack.
#define ETMLX_UNROLL _Pragma("GCC unroll 16")

namespace etmlx::kernels {

struct RowsVariant {
  const char* name;
  void (*dot)(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out, int64_t ldo);
  void (*dequantize)(const QuantizedMatrix& w, int n_begin, int n_end, float* out);
  // Whether `dot` also takes integer activation rows (PreparedRows::hi set) for groups a multiple of 64.
  bool integer_rows = false;
  // prepare_integer_activations in this variant's instructions; set exactly when integer_rows is.
  void (*prepare_integer)(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                          int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums) = nullptr;
  // The widest weights its integer rows take (AVX2's vpmaddubsw would saturate on 8-bit weights: 4).
  int integer_max_bits = 8;
};

// prepare_integer_activations in portable C++ (quantized_rows.cpp): quantize_activation_group per group, then
// the integers placed in PreparedRows::hi's order; for variants without a vectorised one.
void prepare_integer_portable(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                              int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums);

// The same from AVX2 (quantized_rows_x86.cpp), for an AVX2+FMA CPU: the integers and steps bit for bit, the sums
// and residuals in float32 lanes. Elsewhere the portable loop.
void prepare_integer_avx2(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                          int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums);

const RowsVariant& scalar_rows();
// nullptr when the file was not built for this architecture or the CPU lacks the features.
const RowsVariant* avx2_rows();
const RowsVariant* avx512_rows();
const RowsVariant* neon_rows();

// Values per block of the integer (VNNI) loop: 32 packed bytes at 4 bits, 64 at 8; one vpdpbusd each.
constexpr int kIntBlock = 64;

// Activation values per chunk: every variant reads W 32 values at a time (16 bytes at 4 bits, 32 at
// 8); group sizes 32, 64 and 128 are whole chunks.
constexpr int kChunk = 32;

template <ScaleType T>
inline float load_scale(const void* base, int64_t i) {
  if constexpr (T == ScaleType::f32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == ScaleType::bf16) {
    const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
    return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// Calls fn.template operator()<BITS, M, T>() for the runtime bits (4, 8), rows (1..kMaxRows) and scale type.
template <typename Fn>
inline void dispatch_rows(int bits, int m, ScaleType t, Fn&& fn) {
  auto by_type = [&]<int B, int M>() {
    switch (t) {
      case ScaleType::f32: fn.template operator()<B, M, ScaleType::f32>(); break;
      case ScaleType::f16: fn.template operator()<B, M, ScaleType::f16>(); break;
      case ScaleType::bf16: fn.template operator()<B, M, ScaleType::bf16>(); break;
    }
  };
  auto by_rows = [&]<int B>() {
    switch (m) {
      case 1: by_type.template operator()<B, 1>(); break;
      case 2: by_type.template operator()<B, 2>(); break;
      case 3: by_type.template operator()<B, 3>(); break;
      default: by_type.template operator()<B, 4>(); break;
    }
  };
  if (bits == 4) {
    by_rows.template operator()<4>();
  } else {
    by_rows.template operator()<8>();
  }
}

template <typename Fn>
inline void dispatch_dequantize(int bits, ScaleType t, Fn&& fn) {
  dispatch_rows(bits, 1, t, [&]<int B, int M, ScaleType T>() { fn.template operator()<B, T>(); });
}

}  // namespace etmlx::kernels
