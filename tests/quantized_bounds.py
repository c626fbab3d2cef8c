"""The stated tolerance of the cpu kernel set's quantized products (kernels/quantized_matmul_cpu.cpp) against
mx.quantized_matmul in float32: shared by the tests that check a QuantizedLinear's output."""

from __future__ import annotations

import numpy as np
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.runtime import kernels_info

MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}


def _mx(t: torch.Tensor):
    return mx.array(t.float().numpy()).astype(MX_DTYPES[t.dtype])


# The largest integer of each activation precision (kernels/quantized_activations.h).
INTEGER_MAX = {"int16": 127 * 256, "int8": 127}


def quantized_product_bound(x: torch.Tensor, lin, ref: np.ndarray, dtype, activations: str | None = None) -> np.ndarray:
    """How far the cpu set's x @ lin (a QuantizedLinear) may be from `ref`, mx.quantized_matmul in float32
    rounded to x's dtype. Both sides sum K float32 products in different orders, so they may differ
    by up to K * 2^-24 of the sum of the products' magnitudes (4x margin); bfloat16 results may then
    round to neighbouring values, one bfloat16 step (at most 2^-7 of the value) apart. With integer activations
    (`activations`, default: what this process's kernels use) each group g of a row is rounded to
    step_g = max|x_g| / qmax, at most step_g / 2 per value, and meets the centred weights (q - 2^(bits-1)):
    sum_g |scale_g| * step_g / 2 * sum_i |q_i - 2^(bits-1)| more (kernels/quantized_rows.h)."""
    w = np.array(mx.dequantize(mx.array(lin.weight.numpy()), _mx(lin.scales),
                               _mx(lin.biases), group_size=lin.group_size, bits=lin.bits).astype(mx.float32))
    xf = x.float().numpy().reshape(-1, x.shape[-1])
    magnitude = np.abs(xf) @ np.abs(w).T
    bound = 4 * x.shape[-1] * 2.0 ** -24 * magnitude + 1e-30
    activations = activations or kernels_info()["activations"]
    if activations in INTEGER_MAX:
        g = lin.group_size
        steps = np.abs(xf).reshape(len(xf), -1, g).max(axis=2) / INTEGER_MAX[activations]  # [m, groups]
        q = np.array(mx.dequantize(mx.array(lin.weight.numpy()), mx.ones_like(_mx(lin.scales)).astype(mx.float32),
                                   mx.zeros_like(_mx(lin.biases)).astype(mx.float32), group_size=g,
                                   bits=lin.bits))  # the integers, [n, k]
        centred = np.abs(q - 2 ** (lin.bits - 1))
        per_group = np.abs(lin.scales.float().numpy()) * centred.reshape(len(q), -1, g).sum(axis=2)  # [n, groups]
        bound = bound + (steps / 2 * 1.001) @ per_group.T
    bound = bound.reshape(ref.shape)
    if dtype == torch.bfloat16:
        bound = bound + 2.0 ** -7 * np.abs(ref)
    return bound
