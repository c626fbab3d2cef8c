"""layer_norm (native_layer_norm's three outputs), computed in float32 for half inputs.

When only the normalized output is used (nn.LayerNorm) over the last axis, it is one
LayerNormNode (mlx::core::fast::layer_norm); otherwise mean and rstd are composed too.
"""

from __future__ import annotations

import operator

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, float_only, half_type, ndim, out_dtype
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.ReduceOp import ReduceOp
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp


def _static_normalized(node):
    shape = node.args[1]
    return None if all(isinstance(s, int) for s in shape) else "symbolic normalized_shape"


def _only_output_used(node) -> bool:
    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _fused_layer_norm(b, node, compute):
    """One fast::layer_norm. Half inputs go in as float32 so the result is rounded once, as
    torch's kernel and the composed path do (the kernel alone would round after the
    normalization, the weight and the bias)."""
    src, _, weight, bias, eps = node.args[:5]
    dtype = src.meta["val"].dtype
    fields = dict(x=b.operand(src, compute), eps=float(eps))
    if weight is not None:
        fields["weight"] = b.operand(weight, compute)
    if bias is not None:
        fields["bias"] = b.operand(bias, compute)
    return (b.cast(b.op("LayerNormNode", **fields), compute, dtype), None, None)


@REGISTRY.register(aten.native_layer_norm.default, supports=lambda n: float_only(n.args[0]) or _static_normalized(n))
def _native_layer_norm(b, node):
    src, normalized_shape, weight, bias, eps = node.args[:5]
    dtype = src.meta["val"].dtype
    compute = torch.float32 if half_type(dtype) else dtype
    if b.fuse and len(normalized_shape) == 1 and _only_output_used(node):
        return _fused_layer_norm(b, node, compute)
    rank = ndim(src)
    axes = list(range(rank - len(normalized_shape), rank))
    x = b.operand(src, compute)
    mean = b.op("ReduceNode", op=ReduceOp.Mean, x=x, axes=axes, keepdims=True)
    centered = b.op("BinaryNode", op=BinaryOp.Subtract, a=x, b=mean)
    var = b.op("ReduceNode", op=ReduceOp.Mean, x=b.op("UnaryNode", op=UnaryOp.Square, x=centered), axes=axes,
               keepdims=True)
    rstd = b.op("UnaryNode", op=UnaryOp.Rsqrt, x=b.op("BinaryNode", op=BinaryOp.Add, a=var, b=b.full(eps, compute)))
    out = b.op("BinaryNode", op=BinaryOp.Multiply, a=centered, b=rstd)
    if weight is not None:
        out = b.op("BinaryNode", op=BinaryOp.Multiply, a=out, b=b.operand(weight, compute))
    if bias is not None:
        out = b.op("BinaryNode", op=BinaryOp.Add, a=out, b=b.operand(bias, compute))
    return (b.cast(out, compute, dtype), b.cast(mean, compute, dtype), b.cast(rstd, compute, dtype))
