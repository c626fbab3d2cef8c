// The cpu kernel set's decode-step attention over an MLX affine-quantized KV cache (QuantizedSdpaNode with few
// query rows) as one host loop.
//
// Why: MLX's CPU quantized matmul, which the node's few-row route multiplies the packed cache with (as mlx-lm's
// quantized attention does), is a plain scalar loop, and the route first copies the visible part of the cache;
// a 4-bit cache then decoded slower than a float one (0.63x at 8k keys on the 8B shape). Here each block of 64
// keys is dequantized into a small float buffer (in cache) and the float decode loop's own row functions
// (attention_rows.h) run over it, so a step reads the cache once, packed.
#pragma once

#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// Attention of q [B, H, L, D] (float32, a few rows) against the keys [0, key_end) of a packed cache. `cache`
// holds the keys' bytes (uint8 [B, Hkv, S, D * bits / 8], MLX's packing: for 4 bits element 2i in the low
// nibble of byte i), their scales and biases ([B, Hkv, S, D / group_size] in float32, bfloat16 or float16, all
// four the same), then the same three for the values. `mask` (bool or float32, up to 4-d, each dim 1 or
// [B, H, L, key_end]'s) is applied as sdpa's. The result [B, H, L, Dv] float32 equals sdpa_cpu over
// mx::dequantize's keys and values (with the scales widened to float32) bit for bit.
// nullopt where the loop does not apply (no AVX-512, another dtype or shape, the batch-invariant mode): the
// caller then takes MLX's ops.
std::optional<mlx::core::array> sdpa_quantized_decode_cpu(const mlx::core::array& q,
                                                          const std::vector<mlx::core::array>& cache, float scale,
                                                          const std::optional<mlx::core::array>& mask, int key_end,
                                                          int group_size, int bits);

}  // namespace etmlx::kernels
