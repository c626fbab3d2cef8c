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
// (prepare_activations): a variant then never has to interleave nibbles. With float32 activations
// all arithmetic is in float32, as MLX's own CPU kernel does it; only the order of the additions
// differs. With integer activations (quantized_activations.h: int16 by default where the CPU has
// AVX-512 VNNI) x_g . q_g is an exact integer sum of the rounded activations (PreparedRows::hi/lo).
//
// Variants, picked once at run time from the CPU's features: AVX-512 (F+BW; with VNNI, integer
// rows too), AVX2+FMA (integer rows at 4 bits: vpmaddubsw; x86-64, each in functions with their own
// target attribute so the binary runs on any x86-64), NEON (arm64), and a portable scalar loop.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/quantized_activations.h"

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
  const float* x;           // [m, k]; unused (may be null) when `hi` is set
  const float* group_sums;  // [m, k / group]: sum of each group of x's values
  int m;
  // Integer activations (quantized_activations.h), when the call uses them: the AVX-512 VNNI loop then
  // reads these instead of x. [m, k] bytes each, per 64 values in the order that loop reads W (4 bits:
  // the 32 even values, then the 32 odd ones; 8 bits: as they are); `lo` only for int16; one step per
  // group, [m, k / group].
  const int8_t* hi = nullptr;
  const int8_t* lo = nullptr;
  const float* steps = nullptr;
  // [m, k / group]: sum over the group of x_i - step * q_i, the rounding the integers left. The loop
  // computes scale * step * (q_w . q_x) + bias * sum(x) + 2^(bits-1) * scale * residual, which is
  // scale * ((q_w - 2^(bits-1)) . (x - rounding)) + (bias + 2^(bits-1) * scale) * sum(x): the rounding
  // meets the centred weights (|q_w - 8| <= 8 at 4 bits), about half the error of meeting q_w (<= 15).
  const float* residuals = nullptr;
};

// A float32 scale or bias from either stored type.
float scale_to_float(const void* base, ScaleType type, int64_t index);
float f16_to_float(uint16_t h);

// xp [m, k] and sums [m, k / group] from x [m, k] float32.
void prepare_activations(const float* x, int m, int k, int bits, int group, float* xp, float* sums);

// The integer rows of PreparedRows for m rows of x [m, k] at `precision` (int16 or int8; a group a multiple
// of kIntBlock = 64): hi [m, k], lo [m, k] (int16 only; else may be null), steps and residuals [m, k / group]
// (quantize_activation_group's integers and steps), and each group's sum of x. Only where
// rows_precision() is not float32 (the variant in use has integer rows).
void prepare_integer_activations(const float* x, int m, int k, int bits, int group, ActivationPrecision precision,
                                 int8_t* hi, int8_t* lo, float* steps, float* residuals, float* sums);

// The precision the few-row loop runs for W's bits and group on this CPU: `wanted` (the program's) where
// the variant in use has integer loops for them (AVX-512 with VNNI, or AVX2 at 4 bits; groups a multiple of
// 64), else float32.
ActivationPrecision rows_precision(int bits, int group, ActivationPrecision wanted);

// A call's activation rows, prepared once for every matrix of its shape that reads them.
class PreparedActivations {
 public:
  void prepare(const float* x, int m, int k, int bits, int group, ActivationPrecision wanted);
  // Rows [first, first + count) (count <= kMaxRows).
  PreparedRows rows(int first, int count) const;

 private:
  std::vector<float> xp_, sums_, steps_, residuals_;
  std::vector<int8_t> hi_, lo_;
  int k_ = 0, groups_ = 0;
  ActivationPrecision precision_ = ActivationPrecision::float32;
};

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
