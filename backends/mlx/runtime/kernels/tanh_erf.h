// Element-wise tanh and erf (UnaryOp::Tanh / UnaryOp::Erf: GELU's tanh and exact forms), by kernel set.
//
//   device  mx::tanh, mx::erf.
//   cpu     float32 on an AVX-512 CPU (8 lanes at a time on an AVX2+FMA one), on the kernels' pool:
//           erf   MLX's own CPU formula (simd/math.h erf: a reciprocal, an fma polynomial, MLX's exp), every step
//                 rounded as MLX rounds it, so the bits are mx.erf's.
//           tanh  Cephes tanhf: an odd polynomial below |x| = 0.625, else 1 - 2 / (exp(2|x|) + 1) with a Cephes
//                 exp (exp_vectors.h), within 2 ulp of tanh (MLX's is glibc's tanhf, which no vector code matches
//                 bit for bit); the sign of x, -0 and NaN kept.
//           The x86-64 wheel runs both one value at a time (~42 and ~67 ns a value against ~6 for a multiply).
//           Other dtypes and CPUs with neither: MLX's ops.
#pragma once

#include <cstdint>

#include <mlx/array.h>

namespace etmlx::kernels {

using UnaryFn = mlx::core::array (*)(const mlx::core::array& x);

mlx::core::array tanh_device(const mlx::core::array& x);
mlx::core::array erf_device(const mlx::core::array& x);

// Evaluate nothing: the loops run in the call's evaluation (host_kernel.h).
mlx::core::array tanh_cpu(const mlx::core::array& x);
mlx::core::array erf_cpu(const mlx::core::array& x);

}  // namespace etmlx::kernels
