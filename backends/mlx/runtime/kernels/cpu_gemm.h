// Matrix products (MatmulNode, AddmmNode): the CPU variant, and the type of both variants.
#pragma once

#include <mlx/array.h>

namespace etmlx::kernels {

using MatmulFn = mlx::core::array (*)(const mlx::core::array& a, const mlx::core::array& b);
using AddmmFn = mlx::core::array (*)(const mlx::core::array& bias, const mlx::core::array& a,
                                     const mlx::core::array& b, float alpha, float beta);

// On the CPU, MLX multiplies float16/bfloat16 matrices with a generic kernel
// (~2 GFLOP/s here) while float32 goes to BLAS (OpenBLAS through
// libetmlx_blas on Linux, Accelerate on macOS): 40x faster for a prefill-sized
// product and 3x for a decode step, even counting the conversions. So there,
// half-precision products are computed in float32 and rounded once to the
// input dtype, which is also at least as accurate. Other dtypes call MLX
// unchanged, except one-row float32 products (see cpu_gemm.cpp). The device
// variant is mlx::core::matmul / addmm as they are (kernel_set.cpp).
mlx::core::array cpu_matmul(const mlx::core::array& a, const mlx::core::array& b);
mlx::core::array cpu_addmm(const mlx::core::array& bias, const mlx::core::array& a, const mlx::core::array& b,
                           float alpha, float beta);

}  // namespace etmlx::kernels
