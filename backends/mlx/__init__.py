"""etmlx: an ExecuTorch delegate that runs programs on MLX."""

from backends.mlx.runtime import blas_route as _blas_route

# Before anything in this process runs an MLX matmul (see blas_route for why).
_blas_route.load()
