// RMSNorm and LayerNorm through MLX's fused kernels (RmsNormNode, LayerNormNode; semantics in
// schema.fbs). mlx::core::fast trusts its caller's shapes on some devices: the caller checks them.
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// x floating, rank >= 1; weight and bias absent or 1-d with x's last size.
mlx::core::array rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps);
// The CPU kernel set's RMSNorm: one host loop for float32 x (rms_norm_cpu.cpp), else rms_norm().
mlx::core::array rms_norm_cpu(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps);
mlx::core::array layer_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight,
                            const std::optional<mlx::core::array>& bias, float eps);

}  // namespace etmlx::kernels
