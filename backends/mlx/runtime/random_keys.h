// Keys for mlx::core::random::bits from seed tensors, shared by the random nodes.
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx {

// [..., 2] uint32 keys for an integer seed array: (seed >> 32, seed & 0xffffffff) of it as uint64.
mlx::core::array keys_from_seeds(const mlx::core::array& seeds);

// Bits of `shape` as RandomBitsNode defines them: no seed -> MLX's global key sequence;
// 0-d seed -> one key for the whole draw; [N] seed -> row i of shape[0] == N from seed[i].
// Returns nullopt when a [N] seed does not match shape[0].
std::optional<mlx::core::array> draw_bits(const mlx::core::Shape& shape, int width,
                                          const mlx::core::array* seed);

}  // namespace etmlx
