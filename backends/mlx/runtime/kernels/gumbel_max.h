// Gumbel-max sampling: one token per row (GumbelMaxNode; semantics in schema.fbs).
//
// The one definition, in float32, that both variants follow step for step and that
// custom_kernel_ops/reference/sample.py reproduces on the host:
//   x     = logits with NaN -> -inf
//   z     = x / T for rows with T > 0; tokens with z < threshold[row] -> -inf (when a threshold is given)
//   u     = min(float32(bits) / float32(2^32 - 1), nextafter(1, 0)), bits from MLX's random::bits
//   score = z + (-log(-log(u))), NaN -> -inf
//   token = T > 0 ? first argmax(score) : first argmax(x)          (T <= 0 or NaN: greedy)
// Keys: no seed -> the next key of MLX's global sequence, one [B, V] draw; 0-d seed -> key(seed),
// one [B, V] draw; [B] seed -> row r drawn alone ([V]) from key(seed[r]).
//
// Two variants, chosen once per program by kernel_set.h:
//   gumbel_max_device  the steps as mlx ops (lazy, no eval; the logits never leave the device);
//   gumbel_max_cpu     one pass over each row in host memory, a lazy graph node (host_kernel.h):
//                      noise is drawn per token from
//                      MLX's counter layout (threefry.h), so it equals the full draw, and a token
//                      that cannot beat the best so far is skipped before it is hashed.
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// x [B, V] float32 (V > 0); temperature [B] float32; seed absent, 0-d or [B] integer;
// threshold absent or [B] float32. Returns the token ids [B] int64. The caller checks the operands.
using GumbelMaxFn = mlx::core::array (*)(const mlx::core::array& x, const mlx::core::array& temperature,
                                         const std::optional<mlx::core::array>& seed,
                                         const std::optional<mlx::core::array>& threshold);

mlx::core::array gumbel_max_device(const mlx::core::array& x, const mlx::core::array& temperature,
                                   const std::optional<mlx::core::array>& seed,
                                   const std::optional<mlx::core::array>& threshold);

// Every row greedy: first argmax(x) with NaN -> -inf, the T <= 0 branch of the definition above, without
// the noise, the division or the threshold (a graph a GPU's host walks on every greedy step).
mlx::core::array greedy_pick(const mlx::core::array& x);

// Evaluates nothing: the loop runs in the call's evaluation, the unseeded global key one of its operands.
mlx::core::array gumbel_max_cpu(const mlx::core::array& x, const mlx::core::array& temperature,
                                const std::optional<mlx::core::array>& seed,
                                const std::optional<mlx::core::array>& threshold);

}  // namespace etmlx::kernels
