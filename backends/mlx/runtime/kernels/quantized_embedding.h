// QuantizedEmbeddingNode's lookup on the CPU kernel set: one host loop instead of MLX's dequantize.
//
// MLX has no CPU kernel for mx::dequantize: it expands into its reference ops (a left and a right shift,
// an expand_dims and two broadcasts per value in a word, a concatenate, casts, the gathers of the packed
// rows, scales and biases, a multiply and an add): ~45 graph nodes for one token's embedding, at a few
// microseconds each per decode step. This loop unpacks the looked-up rows and computes the same q * scale,
// then + bias, in the scales' dtype, each rounded on its own (the file is built with -ffp-contract=off), so
// the bits are MLX's.
#pragma once

#include <mlx/array.h>

namespace etmlx::kernels {

// rows (integer, any shape, already wrapped and clamped into [0, N)) looked up in the packed w [N, K * bits
// / 32] with scales and biases [N, K / group] of one dtype (float32, bfloat16 or float16): *out = [rows..., K]
// in that dtype and true; false (out untouched) where it does not apply (bits other than 2, 4, 8; other
// dtypes; weights not materialised row-contiguous): the caller then uses mx::dequantize.
bool quantized_embedding_cpu(const mlx::core::array& rows, const mlx::core::array& w, const mlx::core::array& scales,
                             const mlx::core::array& biases, int group_size, int bits, mlx::core::array* out);

}  // namespace etmlx::kernels
