// The packed allowed-token mask (AllowedMaskNode; semantics in schema.fbs):
//   out[r, j] = bit (j % 32) of mask[r, j / 32] set ? x[r, j] : -inf
// Two variants, chosen once per program by kernel_set.h:
//   allowed_mask_device  unpacks the bits with mlx ops and selects (lazy, no eval);
//   allowed_mask_cpu     reads the words on the host: when the mask is already there (a program
//                        input) and every row is all ones (the unconstrained case) it returns x
//                        itself, no pass over V; otherwise a lazy host loop node (host_kernel.h)
//                        makes one copy of x with the masked tokens set to -inf, whole words at a time.
#pragma once

#include <mlx/array.h>

namespace etmlx::kernels {

// x [B, V] float32 (V > 0); mask [B, ceil(V/32)] int32. The caller checks the operands.
using AllowedMaskFn = mlx::core::array (*)(const mlx::core::array& x, const mlx::core::array& mask);

mlx::core::array allowed_mask_device(const mlx::core::array& x, const mlx::core::array& mask);

// Evaluates nothing: reads the mask now only if the host already holds it (known_values.h).
mlx::core::array allowed_mask_cpu(const mlx::core::array& x, const mlx::core::array& mask);

// DrawnOrNoneNode: tokens [B] integer (ids the sampler drew), x [B, V] float32 -> [B] int64, -1 where x[r, tokens[r]] is -inf.
using DrawnOrNoneFn = mlx::core::array (*)(const mlx::core::array& tokens, const mlx::core::array& x);

mlx::core::array drawn_or_none_device(const mlx::core::array& tokens, const mlx::core::array& x);

// A host loop over the B drawn ids, run as a lazy graph node (host_kernel.h).
mlx::core::array drawn_or_none_cpu(const mlx::core::array& tokens, const mlx::core::array& x);

}  // namespace etmlx::kernels
