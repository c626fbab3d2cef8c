// Element-wise sigmoid (UnaryOp::Sigmoid; SiLU's gate in most decoders), by kernel set.
//
//   device  mx::sigmoid.
//   cpu     float32 on an AVX-512 CPU (on an AVX2+FMA one, 8 lanes at a time): MLX's own CPU formula (mlx/backend/cpu/unary_ops.h Sigmoid
//           over simd/math.h exp: a degree-6 polynomial in the fraction of x * log2(e), scaled by
//           2^round(x * log2(e))) evaluated 16 lanes at a time, every step rounded as MLX rounds it,
//           so the bits are MLX's. The x86-64 wheel runs that formula one value at a time, its fmas
//           through libm calls: ~5% of a 4-bit Qwen2.5-0.5B decode step's CPU time. Anything else
//           (other dtypes, CPUs with neither) goes to mx::sigmoid.
#pragma once

#include <cstdint>

#include <mlx/array.h>

namespace etmlx::kernels {

using SigmoidFn = mlx::core::array (*)(const mlx::core::array& x);

mlx::core::array sigmoid_device(const mlx::core::array& x);

// Evaluates nothing: the loop runs in the call's evaluation (host_kernel.h).
mlx::core::array sigmoid_cpu(const mlx::core::array& x);

// sigmoid_cpu's loop on host memory (out may be x): the same bits. False, doing nothing, where
// sigmoid_cpu would use mx::sigmoid instead (neither AVX-512 nor AVX2+FMA).
bool sigmoid_f32_host(const float* x, float* out, int64_t n);

}  // namespace etmlx::kernels
