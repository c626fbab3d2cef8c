"""torch.ops.mlx.quantized_linear / quantized_embedding: layers over MLX affine-quantized weights.

The layout is MLX's (mlx.core.quantize, mode "affine"): a [N, K] weight becomes `w` uint32
[N, K * bits / 32] (each word holds 32 / bits integers, the first in the lowest bits), `scales` and
`biases` [N, K / group_size], and dequantize(w)[n, k] = scales[n, g] * q[n, k] + biases[n, g] for
g = k // group_size. The delegate runs them with mlx::core::quantized_matmul and a gather +
dequantize (QuantizedLinearNode / QuantizedEmbeddingNode in schema.fbs); the CPU implementations
here are the host reference (dequantize, then the float op), used by eager runs and tests.
"""

from __future__ import annotations

from typing import Optional

import torch

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def check_params(group_size: int, bits: int, in_features: int) -> None:
    """One-line errors for what MLX's affine kernels do not take."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit quantization is not supported (bits must be one of {BITS})")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size {group_size} is not supported (one of {GROUP_SIZES})")
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {in_features}")


def unpack(w: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 [N, K * bits / 32] -> the integers, int32 [N, K]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    # The words as int32 (same bits): the arithmetic shift fills the top with copies of bit 31, which the
    # mask drops; 4 bytes per integer rather than the 8 of an int64 widening (1 GB for a 0.5B model's head).
    words = w.view(torch.int32).unsqueeze(-1)
    return ((words >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], w.shape[-1] * per_word)


# Weights per dequantized block in the eager linear: bounds its float copy (64 MB in float32) instead of widening
# a whole matrix (545 MB for Qwen2.5-0.5B's tied head, with 1 GB of integers beside it) for a reference forward.
# Not smaller: glibc serves blocks under its mmap threshold (up to 32 MB) from the heap, and keeps them
# after they are freed.
_BLOCK_ELEMENTS = 1 << 24


def dequantize(w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
               bits: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float [N, K] weight (in `dtype`, default the scales') the packed triple stands for."""
    q = unpack(w, bits).to(torch.float32)
    rows, k = q.shape
    grouped = q.view(rows, k // group_size, group_size)
    out = grouped * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return out.view(rows, k).to(dtype or scales.dtype)


def _in_features(w: torch.Tensor, bits: int) -> int:
    return w.shape[-1] * 32 // bits


lib = torch.library.Library("mlx", "FRAGMENT")
lib.define("quantized_linear(Tensor x, Tensor w, Tensor scales, Tensor biases, Tensor? bias, int group_size, "
           "int bits) -> Tensor")
lib.define("quantized_embedding(Tensor indices, Tensor w, Tensor scales, Tensor biases, int group_size, "
           "int bits) -> Tensor")


@torch.library.impl(lib, "quantized_linear", "CompositeExplicitAutograd")
def _quantized_linear(x, w, scales, biases, bias: Optional[torch.Tensor], group_size: int, bits: int):
    # In the promoted type of x and the scales, as mx.quantized_matmul: float32 activations over bf16 scales
    # (mlx_lm.convert -q of a bf16 checkpoint) multiply in float32; the result is in x's dtype.
    compute = torch.promote_types(x.dtype, scales.dtype)
    xc, bias = x.to(compute), None if bias is None else bias.to(compute)
    blocks, step = [], max(1, _BLOCK_ELEMENTS // _in_features(w, bits))
    for r in range(0, w.shape[0], step):
        rows = slice(r, r + step)
        weight = dequantize(w[rows], scales[rows], biases[rows], group_size, bits, compute)
        blocks.append(torch.nn.functional.linear(xc, weight, None if bias is None else bias[rows]))
    out = torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]
    return out.to(x.dtype)


@torch.library.register_fake("mlx::quantized_linear")
def _quantized_linear_fake(x, w, scales, biases, bias, group_size, bits):
    torch._check(x.shape[-1] == _in_features(w, bits))
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def dequantize_as_mlx(w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
                      bits: int) -> torch.Tensor:
    """dequantize() in the scales' dtype, one rounding per operation as mx.dequantize computes it: for bfloat16
    scales, round(round(scale * q) + bias), where dequantize() rounds once from float32. The embedding's
    program node is mx.dequantize, and a 24-layer model amplified that last-bit difference in the rows it
    looks up into another token (a 0.5B bfloat16 `--quantize int4` export failed its own verification)."""
    if scales.dtype == torch.float32:
        return dequantize(w, scales, biases, group_size, bits)
    q = unpack(w, bits).to(scales.dtype)  # at most 255: exact in float16 and bfloat16
    rows, k = q.shape
    grouped = q.view(rows, k // group_size, group_size)
    return (grouped * scales.unsqueeze(-1) + biases.unsqueeze(-1)).view(rows, k)


@torch.library.impl(lib, "quantized_embedding", "CompositeExplicitAutograd")
def _quantized_embedding(indices, w, scales, biases, group_size: int, bits: int):
    flat = indices.reshape(-1)
    rows = dequantize_as_mlx(w[flat], scales[flat], biases[flat], group_size, bits)
    return rows.view(*indices.shape, rows.shape[-1])


@torch.library.register_fake("mlx::quantized_embedding")
def _quantized_embedding_fake(indices, w, scales, biases, group_size, bits):
    return scales.new_empty((*indices.shape, _in_features(w, bits)))
