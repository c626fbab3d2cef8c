// Scaled dot-product attention through MLX's fused kernel (SdpaNode; semantics in schema.fbs).
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// q [B, H, L, D], k and v [B, Hkv, S, D] (one floating dtype, H a multiple of Hkv), mask
// broadcastable to [B, H, L, S] (boolean, or additive in q's dtype). Only keys [0, key_end)
// are attended (key_end <= S; the caller proved the rest masked out), which also trims a mask
// whose last size is S. Causal needs L == S and no mask.
// Keys [0, key_end) of k and v (axis 2), and of a mask whose last size is S, in place; nothing when key_end >= S.
void keep_first_keys(mlx::core::array& k, mlx::core::array& v, std::optional<mlx::core::array>& mask, int key_end);
mlx::core::array sdpa(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale,
                      bool causal, const std::optional<mlx::core::array>& mask, int key_end);

}  // namespace etmlx::kernels
