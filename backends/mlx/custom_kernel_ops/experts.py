"""torch.ops.mlx.gather_mm / gather_qmm: MoE expert matmuls, each (token, k) pair through its own expert.

For x [T, in] (every k reads the row) or [T, K, in], indices [T, K] and a stack of expert matrices,
out[t, k] = W[indices[t, k]] @ x[t, (k)] -> [T, K, out]. gather_mm's stack is float, [E, out, in] or,
with `transposed`, [E, in, out] (transformers' is_transposed layout, multiplied as x @ W[e]);
gather_qmm's is MLX affine-quantized per expert ([E, out, in] packed as in quantized.py). The delegate
runs them with mlx::core::gather_mm / gather_qmm (GatherMmNode / GatherQmmNode), which index the stack
instead of building the [T, K, out, in] gather of it. The CPU implementations here are the host
reference: a loop over the experts that were hit.
"""

from __future__ import annotations

import torch

from backends.mlx.custom_kernel_ops.quantized import check_params, dequantize

lib = torch.library.Library("mlx", "FRAGMENT")
lib.define("gather_mm(Tensor x, Tensor w, Tensor indices, bool transposed) -> Tensor")
lib.define("gather_qmm(Tensor x, Tensor w, Tensor scales, Tensor biases, Tensor indices, int group_size, "
           "int bits) -> Tensor")


def check_operands(op: str, x: torch.Tensor, indices: torch.Tensor, in_features: int, dtype: torch.dtype):
    """One-line errors for operands the expert ops do not take (raised while tracing, so at export)."""
    if indices.dim() != 2 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"mlx::{op}: indices must be an integer [tokens, k] tensor, got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if x.dim() not in (2, 3):
        raise ValueError(f"mlx::{op}: x must be [tokens, in] or [tokens, k, in], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"mlx::{op}: x is {x.dtype} but the experts compute in {dtype}")
    torch._check(x.shape[0] == indices.shape[0], lambda: f"mlx::{op}: x and indices differ in tokens")
    if x.dim() == 3:
        torch._check(x.shape[1] == indices.shape[1], lambda: f"mlx::{op}: x and indices differ in k")
    if x.shape[-1] != in_features:
        raise ValueError(f"mlx::{op}: x's last size {x.shape[-1]} is not the experts' {in_features} inputs")


def _per_expert(x: torch.Tensor, indices: torch.Tensor, out_features: int, matrix) -> torch.Tensor:
    """out[t, k] = x[t, (k)] @ matrix(e).T for e = indices[t, k], one expert at a time."""
    rows = x.unsqueeze(1).expand(*indices.shape, x.shape[-1]) if x.dim() == 2 else x
    out = rows.new_zeros((*indices.shape, out_features))
    for e in torch.unique(indices).tolist():
        hit = indices == e
        out[hit] = rows[hit] @ matrix(e).t().to(rows.dtype)
    return out


@torch.library.impl(lib, "gather_mm", "CompositeExplicitAutograd")
def _gather_mm(x, w, indices, transposed: bool):
    out_features = w.shape[-1] if transposed else w.shape[1]
    return _per_expert(x, indices, out_features, lambda e: w[e].t() if transposed else w[e])


@torch.library.register_fake("mlx::gather_mm")
def _gather_mm_fake(x, w, indices, transposed):
    if w.dim() != 3:
        raise ValueError(f"mlx::gather_mm: expert weights must be 3-d, got {tuple(w.shape)}")
    check_operands("gather_mm", x, indices, w.shape[1] if transposed else w.shape[2], w.dtype)
    return x.new_empty((*indices.shape, w.shape[2] if transposed else w.shape[1]))


@torch.library.impl(lib, "gather_qmm", "CompositeExplicitAutograd")
def _gather_qmm(x, w, scales, biases, indices, group_size: int, bits: int):
    return _per_expert(x, indices, w.shape[1],
                       lambda e: dequantize(w[e], scales[e], biases[e], group_size, bits))


@torch.library.register_fake("mlx::gather_qmm")
def _gather_qmm_fake(x, w, scales, biases, indices, group_size, bits):
    if w.dim() != 3 or w.dtype != torch.uint32:
        raise ValueError(f"mlx::gather_qmm: packed expert weights must be 3-d uint32, got {w.dtype} "
                         f"{tuple(w.shape)}")
    in_features = w.shape[-1] * 32 // bits
    check_params(group_size, bits, in_features)
    check_operands("gather_qmm", x, indices, in_features, scales.dtype)
    return x.new_empty((*indices.shape, w.shape[1]))
