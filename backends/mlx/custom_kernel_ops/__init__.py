"""torch custom ops that the etmlx delegate lowers (importing registers them)."""

from backends.mlx.custom_kernel_ops import filter_threshold, quantized, sample  # noqa: F401
