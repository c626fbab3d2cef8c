"""torch custom ops that the etmlx delegate lowers (importing registers them)."""

from backends.mlx.custom_kernel_ops import (allowed_mask, collectives, experts, filter_threshold, quantized,  # noqa: F401
                                            quantized_attention, sample)
