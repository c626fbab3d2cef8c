// Matrix products that pick the fast MLX path for the device they run on.
#pragma once

#include <mlx/mlx.h>

namespace etmlx {

// On the CPU, MLX multiplies float16/bfloat16 matrices with a generic kernel
// (~2 GFLOP/s here) while float32 goes to BLAS (OpenBLAS through
// libetmlx_blas on Linux, Accelerate on macOS): 40x faster for a prefill-sized
// product and 3x for a decode step, even counting the conversions. So there,
// half-precision products are computed in float32 and rounded once to the
// input dtype, which is also at least as accurate. Other devices and dtypes
// call MLX unchanged.
mlx::core::array device_matmul(const mlx::core::array& a, const mlx::core::array& b);
mlx::core::array device_addmm(const mlx::core::array& bias, const mlx::core::array& a,
                              const mlx::core::array& b, float alpha, float beta);

}  // namespace etmlx
