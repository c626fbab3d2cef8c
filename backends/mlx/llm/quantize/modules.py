"""nn.Modules over MLX affine-quantized weights, drop-in for nn.Linear and nn.Embedding.

They hold the packed triple as buffers and call the mlx:: custom ops, which the delegate lowers to
MLX's quantized kernels. A tied head is a QuantizedLinear holding the embedding's very tensors, so
the program stores them once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from backends.mlx.custom_kernel_ops import quantized as q


class _Packed(nn.Module):
    def __init__(self, w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int,
                 ndim: int = 2):
        super().__init__()
        if w.dtype != torch.uint32 or w.dim() != ndim:
            raise ValueError(f"packed weights must be {ndim}-d uint32, got {w.dtype} {tuple(w.shape)}")
        in_features = w.shape[-1] * 32 // bits
        q.check_params(group_size, bits, in_features)
        expected = (*w.shape[:-1], in_features // group_size)
        if tuple(scales.shape) != expected or tuple(biases.shape) != expected:
            raise ValueError(f"scales/biases {tuple(scales.shape)}/{tuple(biases.shape)} do not match packed "
                             f"weights {tuple(w.shape)} at {bits} bits, group size {group_size} (need {expected})")
        self.register_buffer("weight", w)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)
        self.group_size, self.bits = group_size, bits

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    def packed(self) -> tuple:
        return self.weight, self.scales, self.biases, self.group_size, self.bits

    def extra_repr(self) -> str:
        return f"{'x'.join(map(str, self.weight.shape[:-1]))}x{self.in_features}, bits={self.bits}, group_size={self.group_size}"


class QuantizedLinear(_Packed):
    def __init__(self, w, scales, biases, group_size: int, bits: int, bias: Optional[torch.Tensor] = None):
        super().__init__(w, scales, biases, group_size, bits)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mlx.quantized_linear(x, self.weight, self.scales, self.biases, self.bias,
                                              self.group_size, self.bits)


def embedding_scales(scales: torch.Tensor, biases: torch.Tensor, activations: torch.dtype) -> tuple:
    """The scales and biases a QuantizedEmbedding keeps under `activations`. With float32 activations, bfloat16
    or float16 ones (mlx_lm.convert -q of a bf16 checkpoint) are widened to float32, exactly: the looked-up rows
    then dequantize in float32, as an mlx-lm float32 model computes them, instead of being rounded to bfloat16
    before the first float32 op (a ~1% logit gap after a few steps of a 150M model). The file stores the
    embedding's scales at 4 bytes (a tied head shares them); every other layer keeps its own as stored."""
    if activations == torch.float32 and scales.dtype != torch.float32:
        return scales.float(), biases.float()
    return scales, biases


class QuantizedEmbedding(_Packed):
    def __init__(self, w, scales, biases, group_size: int, bits: int, scale: Optional[float] = None):
        super().__init__(w, scales, biases, group_size, bits)
        self.scale = scale  # rows multiplied by it (Gemma's embed_scale); None: as stored

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.mlx.quantized_embedding(indices, self.weight, self.scales, self.biases,
                                                 self.group_size, self.bits)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


class QuantizedExperts(_Packed):
    """A MoE projection's stack of E expert matrices [E, out, in], each quantized like a QuantizedLinear
    weight. Called as experts(x, indices) by the etmlx experts forward (llm/experts.py): x [T, in]
    or [T, K, in] and indices [T, K] -> [T, K, out], each pair through its own expert."""

    def __init__(self, w, scales, biases, group_size: int, bits: int):
        super().__init__(w, scales, biases, group_size, bits, ndim=3)

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return torch.ops.mlx.gather_qmm(x, self.weight, self.scales, self.biases, indices, self.group_size,
                                        self.bits)
