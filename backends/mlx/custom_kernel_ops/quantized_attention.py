"""torch.ops.mlx.quantized_sdpa: attention over an MLX affine-quantized KV cache.

The cache holds, per layer, the keys and values as MLX's affine packing (mlx.core.quantize along the head
dimension, as mlx-lm's QuantizedKVCache): `k` uint8 [B, Hkv, S, D * bits / 8] (the bytes of MLX's uint32
words, little-end first: for 4 bits, element 2i in the low nibble of byte i), `k_scales` and `k_biases`
[B, Hkv, S, D / group_size] (in q's dtype, or another float dtype: --kv-scale-dtype); the same for the values.
The delegate lowers the op to QuantizedSdpaNode (schema.fbs), which multiplies the packed cache with
mlx::core::quantized_matmul; the CPU implementation here is the host reference (dequantize, then float
attention), used by eager runs and tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from backends.mlx.custom_kernel_ops.quantized import lib


def unpack_bytes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., D * bits / 8] -> the integers, float32 [..., D] (low bits first, as MLX packs)."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.float32)


def dequantize_cache(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
                     bits: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float [..., D] a packed cache stands for, computed in float32 and rounded to `dtype` (default the
    scales' dtype)."""
    q = unpack_bytes(packed, bits)
    grouped = q.view(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    out = grouped * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return out.view(q.shape).to(dtype or scales.dtype)


lib.define("quantized_sdpa(Tensor q, Tensor k, Tensor k_scales, Tensor k_biases, Tensor v, Tensor v_scales, "
           "Tensor v_biases, Tensor? mask, float scale, int group_size, int bits) -> Tensor")


@torch.library.impl(lib, "quantized_sdpa", "CompositeExplicitAutograd")
def _quantized_sdpa(q, k, k_scales, k_biases, v, v_scales, v_biases, mask: Optional[torch.Tensor], scale: float,
                    group_size: int, bits: int):
    # In q's dtype straight from float32: a float32 program's bfloat16 scales (--kv-scale-dtype) still give float32
    # keys, as the delegate (which widens the scales) computes them.
    keys = dequantize_cache(k, k_scales, k_biases, group_size, bits, q.dtype)
    values = dequantize_cache(v, v_scales, v_biases, group_size, bits, q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                            enable_gqa=keys.shape[1] != q.shape[1])


@torch.library.register_fake("mlx::quantized_sdpa")
def _quantized_sdpa_fake(q, k, k_scales, k_biases, v, v_scales, v_biases, mask, scale, group_size, bits):
    return q.new_empty((*q.shape[:-1], v.shape[-1] * 8 // bits))
