"""The quantized KV cache (`etmlx export --kv-bits 8|4`): keys and values stored MLX-affine quantized.

As mlx-lm's QuantizedKVCache: each position's key (and value) of each head is quantized along the head
dimension in groups of `group_size` (default 64) with one scale and one bias per group. The scales and biases
are in the cache's float dtype (float16 for a float16 model: 4 bits at D = 128 and group 64 keep 72 bytes where
float16 keeps 256, 0.28x), bfloat16 for a float32 model (DEFAULT_SCALES), or `--kv-scale-dtype`'s. Keys and
values are quantized as they are written (`quantize`, the formula of mlx.core.quantize, mode "affine"), and
attention runs over the packed cache (custom_kernel_ops/quantized_attention.py), so every query, the prefill's
included, sees the keys as the cache holds them.

The packed integers are stored as bytes (uint8 [..., D * bits / 8]): the same bytes as MLX's uint32 words on
a little-endian machine, kept in a dtype torch and the prompt-cache file handle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# Widths the eager reference also takes: 2 bits serves as the tests' control (too coarse to pass the bound).
REFERENCE_BITS = (2, 4, 8)
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Without --kv-scale-dtype a float32 cache keeps its scales and biases in bfloat16 (0.9x the bytes at 4 bits and
# group 64): over the test families the teacher-forced logprob gap to a float cache was the same as with float32
# scales (tests/test_kv_quant.py prints both), bfloat16 has float32's range (float16 would turn a key past 65504
# into inf), and it is what mlx-lm's cache holds for a bfloat16 model. A 16-bit cache keeps its own dtype.
DEFAULT_SCALES = {torch.float32: torch.bfloat16}


@dataclass(frozen=True)
class KvQuant:
    bits: int
    group_size: int = 64
    scale_dtype: str = ""  # a SCALE_DTYPES name; "": DEFAULT_SCALES

    def scales_dtype(self, cache_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the scales and biases of a cache whose float dtype is `cache_dtype`."""
        if self.scale_dtype:
            return SCALE_DTYPES[self.scale_dtype]
        return DEFAULT_SCALES.get(cache_dtype, cache_dtype)

    def packed_dim(self, dim: int) -> int:
        return dim * self.bits // 8

    def groups(self, dim: int) -> int:
        return dim // self.group_size


def kv_quant(bits: int, group_size: int = 64, scale_dtype: str = "", *, reference: bool = False) -> KvQuant | None:
    """The checked setting (None for bits 0: a float cache); ValueError (one line) for what MLX cannot take."""
    if scale_dtype and scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"--kv-scale-dtype {scale_dtype!r} is not supported (one of {', '.join(SCALE_DTYPES)})")
    if isinstance(bits, bool) or not isinstance(bits, int) or isinstance(group_size, bool) \
            or not isinstance(group_size, int):
        raise ValueError(f"kv_bits and kv_group_size must be ints, got {bits!r} and {group_size!r}")
    if bits == 0:
        if scale_dtype:
            raise ValueError("--kv-scale-dtype needs a quantized cache (--kv-bits 4 or 8)")
        return None
    allowed = REFERENCE_BITS if reference else BITS
    if bits not in allowed:
        raise ValueError(f"--kv-bits {bits} is not supported (one of {', '.join(map(str, allowed))}; 0: float)")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--kv-group-size {group_size} is not supported (one of "
                         f"{', '.join(map(str, GROUP_SIZES))})")
    return KvQuant(bits, group_size, scale_dtype)


def check_head_dim(setting: KvQuant, dim: int, what: str) -> None:
    if dim % setting.group_size:
        raise ValueError(f"--kv-group-size {setting.group_size} does not divide the {what} head size {dim}: "
                         "pick a group size that does (32, 64 or 128)")


def quantize(x: torch.Tensor, setting: KvQuant, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D * bits / 8], scales, biases [..., D / group_size] in `dtype`).

    mlx.core.quantize's affine rule: the group's edge of larger magnitude (its min or its max) is represented
    exactly (q = 0 maps to it, or to 0 when it rounds to 0), the scale spans the group's range over 2^bits - 1
    steps. Computed in float32; the integers are rounded against the scales and biases as stored."""
    bins = (1 << setting.bits) - 1
    shape = x.shape
    grouped = x.float().reshape(*shape[:-1], shape[-1] // setting.group_size, setting.group_size)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    low_edge = low.abs() > high.abs()
    scales = torch.clamp((high - low) / bins, min=1e-7)
    scales = torch.where(low_edge, scales, -scales)
    edge = torch.where(low_edge, low, high)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / torch.where(q0 != 0, q0, torch.ones_like(q0)), scales)
    biases = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    scales, biases = scales.to(dtype), biases.to(dtype)
    stored = scales.float()
    safe = torch.where(stored == 0, torch.ones_like(stored), stored)
    q = torch.clamp(torch.round((grouped - biases.float()) / safe), 0, bins)
    # Packed by arithmetic (exact in float32 below 256): element j of a byte's 8 / bits sits at bit j * bits.
    per_byte = 8 // setting.bits
    weights = torch.tensor([float(1 << (j * setting.bits)) for j in range(per_byte)])
    packed = (q.reshape(*shape[:-1], shape[-1] // per_byte, per_byte) * weights).sum(-1).to(torch.uint8)
    return packed, scales.squeeze(-1), biases.squeeze(-1)


def cache_bytes(kv_heads: int, slots: int, key_dim: int, value_dim: int, setting: KvQuant | None,
                dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes of one layer's keys and values for `slots` positions, as StaticCacheLM allocates them."""
    size = torch.empty(0, dtype=dtype).element_size()
    per_position = 0
    for dim in (key_dim, value_dim):
        if setting is None:
            per_position += dim * size
        else:
            scale_size = torch.empty(0, dtype=setting.scales_dtype(dtype)).element_size()
            per_position += setting.packed_dim(dim) + 2 * setting.groups(dim) * scale_size
    return batch * kv_heads * slots * per_position
