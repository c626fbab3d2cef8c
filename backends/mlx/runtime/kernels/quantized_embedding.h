// QuantizedEmbeddingNode's lookup on the CPU kernel set: one host loop instead of MLX's dequantize.
//
// MLX has no CPU kernel for mx::dequantize: it expands into its reference ops (a left and a right shift,
// an expand_dims and two broadcasts per value in a word, a concatenate, casts, the gathers of the packed
// rows, scales and biases, a multiply and an add): ~45 graph nodes for one token's embedding, at a few
// microseconds each per decode step. This loop unpacks the looked-up rows and computes the same float32
// q * scale, then + bias, each rounded on its own (the file is built with -ffp-contract=off), so the bits
// are MLX's.
#pragma once

#include <mlx/array.h>

namespace etmlx::kernels {

// rows (integer, any shape, already wrapped and clamped into [0, N)) looked up in the packed w [N, K * bits
// / 32] with float32 scales and biases [N, K / group]: *out = [rows..., K] float32 and true; false (out
// untouched) where it does not apply (bits other than 2, 4, 8; half scales; weights not materialised
// row-contiguous): the caller then uses mx::dequantize.
bool quantized_embedding_cpu(const mlx::core::array& rows, const mlx::core::array& w, const mlx::core::array& scales,
                             const mlx::core::array& biases, int group_size, int bits, mlx::core::array* out);

}  // namespace etmlx::kernels
