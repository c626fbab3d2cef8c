// x @ dequantize(w)^T over MLX's affine layout (QuantizedLinearNode): the type of both variants.
//
//   device  mx::quantized_matmul as it is (kernel_set.cpp).
//   cpu     quantized_matmul_cpu: MLX's CPU kernel is one scalar loop on one thread (a 4-bit
//           Qwen2.5-0.5B decoded at ~2 tok/s), so the cpu set runs its own: for a few rows
//           (decode), a vectorised, multi-threaded pass over the packed weights
//           (quantized_rows.h, thread_pool.h), which reads each weight once for all rows;
//           for many rows (prefill), a tiled GEMM of its own (quantized_gemm.h; elsewhere the weights
//           dequantized to float32 and multiplied by BLAS). Results round once to x's dtype, as MLX does.
//           With float32 activations only the order of the additions differs from mx::quantized_matmul;
//           with integer ones (quantized_activations.h, the default on AVX-512 VNNI CPUs) each product
//           is within the bound stated there. `activations` is the program's (Graph.qmm_activations);
//           the device variant ignores it.
#pragma once

#include <optional>
#include <vector>

#include <mlx/array.h>

#include "kernels/quantized_activations.h"

namespace etmlx::kernels {

// x [..., K] float32/float16/bfloat16; w uint32 [N, K * bits / 32]; scales and biases [N, K / group]
// in x's dtype (the caller checks the layout: quantized_layout.h). Returns [..., N] in x's dtype.
using QuantizedMatmulFn = mlx::core::array (*)(const mlx::core::array& x, const mlx::core::array& w,
                                               const mlx::core::array& scales, const mlx::core::array& biases,
                                               int group_size, int bits, ActivationPrecision activations);

mlx::core::array quantized_matmul_cpu(const mlx::core::array& x, const mlx::core::array& w,
                                      const mlx::core::array& scales, const mlx::core::array& biases,
                                      int group_size, int bits, ActivationPrecision activations);

// One linear of a group that reads the same input: its packed weights, scales, biases (layout
// checked by the caller) and an optional bias [N] added to each result row.
struct QuantizedLinear {
  mlx::core::array w, scales, biases;
  std::optional<mlx::core::array> bias;
  // The reshape and transpose the program applies to this result next (q/k/v to [B, H, L, D]): when set,
  // two more results, the result in `view_shape` and that transposed by `view_perm`, each its own
  // row-contiguous copy (a reshape or transpose node per projection costs more than copying 1K values).
  std::optional<mlx::core::Shape> view_shape;
  std::vector<int> view_perm;
};

// x @ dequantize(W_i)^T (+ bias_i) for every linear of `group` as one graph node and one pass of the
// thread pool (x prepared once), instead of one node, one pool wake-up and one bias add per linear.
// Returns one result per linear, each [..., N_i] with the bits of quantized_matmul_cpu followed by
// mx::add of the bias; or {} where it does not apply (x or a bias not float32, many rows: prefill
// keeps its GEMM), and the caller then runs each linear on its own. With `silu_mul` and two linears
// of one size (gate, up), three more results follow, computed after the products in the same node:
// s = sigmoid(gate) (sigmoid_cpu's bits), gs = gate * s, h = gs * up; only when sigmoid_cpu's host
// loop runs on this CPU (else just the products come back). Then, for each linear with a view (in
// order), its reshaped and transposed copies.
using QuantizedMatmulGroupFn = std::vector<mlx::core::array> (*)(const mlx::core::array& x,
                                                                 const std::vector<QuantizedLinear>& group,
                                                                 int group_size, int bits, bool silu_mul,
                                                                 ActivationPrecision activations);

std::vector<mlx::core::array> quantized_matmul_group_cpu(const mlx::core::array& x,
                                                         const std::vector<QuantizedLinear>& group, int group_size,
                                                         int bits, bool silu_mul, ActivationPrecision activations);

// A decode step's output projection, the residual add after it and the RMSNorm of the sum, as one node:
// {x @ dequantize(w)^T, residual + that, rms_norm_cpu(sum)} with the bits of quantized_matmul_cpu, mx::add
// and rms_norm_cpu; {} where that does not apply (not float32, many rows, a residual of another shape, a
// weight not ready on the host), and the caller runs the three apart.
std::vector<mlx::core::array> quantized_matmul_add_rms_norm_cpu(const mlx::core::array& x, const mlx::core::array& w,
                                                                const mlx::core::array& scales,
                                                                const mlx::core::array& biases, int group_size,
                                                                int bits, const mlx::core::array& residual,
                                                                const std::optional<mlx::core::array>& weight,
                                                                float eps, ActivationPrecision activations);

}  // namespace etmlx::kernels
