// SiLU(g) * u (a gated MLP's "SwiGLU") as one compiled node, by kernel set.
//
//   device  The exporter writes the gate as three instructions: Sigmoid(g), Multiply(that, g), Multiply(that,
//           u). On a GPU each graph node costs the host ~4 us to encode and a decode step is bound by that host
//           time, so the last Multiply, seeing the other two in its operand's graph, returns the whole product
//           as one node from mx::compile (shapeless): what mlx-lm does with its @mx.compile'd swiglu. The same
//           operations in the same order and dtypes, so the same values; the Sigmoid and first product stay
//           unevaluated unless something else reads them. Metal and CUDA compile the fused kernel at run time
//           (CUDA through NVRTC); on a CPU (ETMLX_KERNELS=device, how the tests run this set) MLX compiles it with
//           the system's C++ compiler.
//   cpu     null: the CPU kernel set makes the gate with its quantized linears (quantized_matmul_group_cpu),
//           and MLX's CPU compile would need a C++ compiler at run time.
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// a * b as SiLU(g) * u in one node when one operand is sigmoid(g) * g (either order) of g's shape and dtype
// and the other is u of that shape and dtype; nullopt otherwise (the caller multiplies as usual).
using SiluProductFn = std::optional<mlx::core::array> (*)(const mlx::core::array& a, const mlx::core::array& b);

std::optional<mlx::core::array> silu_product_device(const mlx::core::array& a, const mlx::core::array& b);

}  // namespace etmlx::kernels
