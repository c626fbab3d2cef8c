// RMSNorm and LayerNorm through MLX's fused kernels (RmsNormNode, LayerNormNode; semantics in
// schema.fbs). mlx::core::fast trusts its caller's shapes on some devices: the caller checks them.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// x floating, rank >= 1; weight and bias absent or 1-d with x's last size.
mlx::core::array rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps);
// The CPU kernel set's RMSNorm: one host loop for float32 x (rms_norm_cpu.cpp), else rms_norm().
mlx::core::array rms_norm_cpu(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps);
// The CPU kernel set's residual add and the RMSNorm of its result as one node: {a + b, rms_norm_cpu(a + b)}
// with the bits of mx::add and rms_norm_cpu; {} where that does not apply (not float32, shapes that
// broadcast, a weight not ready on the host), and the caller then runs both on their own.
std::vector<mlx::core::array> add_rms_norm_cpu(const mlx::core::array& a, const mlx::core::array& b,
                                               const std::optional<mlx::core::array>& weight, float eps);
// rms_norm_cpu's row: n values of x (every `step`-th) to out, x * rsqrt(mean(x^2) + eps), times w when
// given. For fused nodes that end in this norm, so their bits are the norm node's.
void rms_norm_row_f32(const float* x, size_t step, int n, const float* w, float eps, float* out);
mlx::core::array layer_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight,
                            const std::optional<mlx::core::array>& bias, float eps);

}  // namespace etmlx::kernels
