// The cpu kernel set's prefill attention: its softmax as a host loop with an AVX-512 (or AVX2) exp, on the thread
// pool (SiLU's sigmoid has its own loop with MLX's exact formula: sigmoid.h).
//
// Why: the mlx[cpu] wheel is built for baseline x86-64, so MLX's exp is a scalar loop whose polynomial
// calls libm's fmaf per step. In a 512-token prefill of a 4-bit Qwen2.5-0.5B that was ~28% of the CPU
// samples (148M exponentials: 88M in attention's softmax, 60M in SiLU), next to 33% in the matmuls.
// Elsewhere (no AVX-512 or AVX2+FMA, other dtypes) both fall back to MLX's ops.
#pragma once

#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// sdpa() (attention.h) with the same arguments: float32 on an AVX-512 or AVX2+FMA CPU as two MLX matmuls per
// key/value head (OpenBLAS) around a host-loop softmax that applies scale, mask and causality itself; fewer
// than 16 query rows (a decode step) as one host loop.
mlx::core::array sdpa_cpu(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale,
                          bool causal, const std::optional<mlx::core::array>& mask, int key_end);

// sdpa_cpu for a few query rows whose result the program transposes by `perm` and then reshapes to
// `shape` (attention's output back to [B, L, H * D] for the output projection): {result, transposed,
// reshaped} from one node, the views as row-contiguous copies; {} where sdpa_cpu would not take its
// decode loop (the caller then runs the three ops as usual).
std::vector<mlx::core::array> sdpa_decode_viewed_cpu(const mlx::core::array& q, const mlx::core::array& k,
                                                     const mlx::core::array& v, float scale, bool causal,
                                                     const std::optional<mlx::core::array>& mask, int key_end,
                                                     const std::vector<int>& perm, const mlx::core::Shape& shape);

// softmax(x) over x's last axis, float32, with the prefill's host-loop softmax (no scale, mask or causality): for a
// program whose attention is spelled as matmul, softmax, matmul (transformers' eager attention, as vision towers
// export) the exponentials are most of its softmax's time. nullopt where that loop does not apply (another dtype or
// CPU, the batch-invariant mode): the caller then takes MLX's op.
std::optional<mlx::core::array> softmax_last_axis_cpu(const mlx::core::array& x);

}  // namespace etmlx::kernels
