// MLX's random bits from seed tensors: the one random source of the graph (RandomBitsNode, GumbelMaxNode).
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// [..., 2] uint32 keys for an integer seed array: (seed >> 32, seed & 0xffffffff) of it as uint64,
// which is exactly mlx::core::random::key(seed), built on the device so a seeded draw never waits for the host.
mlx::core::array keys_from_seeds(const mlx::core::array& seeds);

// Bits of `shape` (width 1, 2 or 4 bytes): no seed -> MLX's global key sequence; 0-d seed -> one key
// for the whole draw; [N] seed -> row i of shape[0] == N drawn alone from seed[i] (what a batch-1
// draw with that seed gives). Returns nullopt when a [N] seed does not match shape[0].
std::optional<mlx::core::array> random_bits(const mlx::core::Shape& shape, int width,
                                            const std::optional<mlx::core::array>& seed);

}  // namespace etmlx::kernels
