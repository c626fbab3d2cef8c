// The inner loops of the cpu kernel set's quantized matmul (quantized_matmul_cpu.cpp), over MLX's
// affine layout, with no MLX types so each instruction-set variant compiles on its own.
//
// Layout (mlx/backend/cpu/quantized.cpp): row n of W holds K values packed little-endian into
// K * bits / 32 uint32 words, value j of the row in bits [bits*j, bits*j + bits) of the byte
// stream (4 bits: value 2i in the low nibble of byte i, 2i + 1 in the high one); value j
// dequantizes to scales[n, j / group] * q + biases[n, j / group].
//
// A product row . W[n] is computed as sum over groups g of
//   scale[g] * (x_g . q_g) + bias[g] * sum(x_g)
// with the activation row converted to float32 once per call and, for 4 bits, reordered so that
// the low nibbles of 16 packed bytes meet x's even values and the high nibbles its odd ones
// (prepare_activations): a variant then never has to interleave nibbles. All arithmetic is in
// float32, as MLX's own CPU kernel does it; only the order of the additions differs.
//
// Variants, picked once at run time from the CPU's features: AVX-512 (F+BW), AVX2+FMA (x86-64,
// each in functions with their own target attribute so the binary runs on any x86-64), NEON
// (arm64), and a portable scalar loop.
#pragma once

#include <cstdint>

namespace etmlx::kernels {

enum class ScaleType : uint8_t { f32, f16, bf16 };

struct QuantizedMatrix {
  const uint32_t* w;     // [n, k * bits / 32]
  const void* scales;    // [n, k / group], scale_type
  const void* biases;    // [n, k / group], scale_type
  ScaleType scale_type;
  int n, k, bits, group;
};

// Activation rows in the order the kernels read them (see above).
struct PreparedRows {
  const float* x;           // [m, k]
  const float* group_sums;  // [m, k / group]: sum of each group of x's values
  int m;
};

// A float32 scale or bias from either stored type.
float scale_to_float(const void* base, ScaleType type, int64_t index);
float f16_to_float(uint16_t h);

// xp [m, k] and sums [m, k / group] from x [m, k] float32.
void prepare_activations(const float* x, int m, int k, int bits, int group, float* xp, float* sums);

// out[r * ldo + j] = row r of the prepared activations . W[n_begin + j], for j < n_end - n_begin
// and every row r < rows.m (at most kMaxRows: the caller splits larger batches). A row's result
// depends only on that row and W: not on rows.m, the row's place among them, or [n_begin, n_end).
constexpr int kMaxRows = 4;
void quantized_dot_rows(const QuantizedMatrix& w, const PreparedRows& rows, int n_begin, int n_end, float* out,
                        int64_t ldo);

// out[(j - n_begin) * k + i] = dequantized W[j, i] for n_begin <= j < n_end, in natural order.
void dequantize_rows(const QuantizedMatrix& w, int n_begin, int n_end, float* out);

// The variant in use ("avx512", "avx2", "neon" or "scalar"); ETMLX_QMM_ISA=scalar|avx2|avx512|neon
// forces one (a name the CPU cannot run falls back to the best it can), so tests reach each.
const char* quantized_rows_isa();

}  // namespace etmlx::kernels
