"""layer_norm (native_layer_norm's three outputs, or layer_norm kept whole), rms_norm and inference
batch norm; computed in float32 for half inputs, as torch does.

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


def _fused_layer_norm(b, src, weight, bias, eps, compute):
    """One fast::layer_norm. Half inputs go in as float32 so the result is rounded once, as
    torch's kernel and the composed path do (the kernel alone would round after the
    normalization, the weight and the bias)."""
    dtype = src.meta["val"].dtype
    fields = dict(x=b.operand(src, compute), eps=float(eps))
    if weight is not None:
        fields["weight"] = b.operand(weight, compute)
    if bias is not None:
        fields["bias"] = b.operand(bias, compute)
    return (b.cast(b.op("LayerNormNode", **fields), compute, dtype), None, None)


def _layer_norm(b, src, normalized_shape, weight, bias, eps, only_output):
    dtype = src.meta["val"].dtype
    compute = torch.float32 if half_type(dtype) else dtype
    if b.fuse and len(normalized_shape) == 1 and only_output:
        return _fused_layer_norm(b, src, weight, bias, eps, compute)
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


@REGISTRY.register(aten.native_layer_norm.default, supports=lambda n: float_only(n.args[0]) or _static_normalized(n))
def _native_layer_norm(b, node):
    src, normalized_shape, weight, bias, eps = node.args[:5]
    return _layer_norm(b, src, normalized_shape, weight, bias, eps, _only_output_used(node))


def _kwarg(node, index, name, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


@REGISTRY.register(aten.layer_norm.default, supports=lambda n: float_only(n.args[0]) or _static_normalized(n))
def _layer_norm_whole(b, node):
    """F.layer_norm kept whole by the partitioner: native_layer_norm's first output."""
    src, normalized_shape = node.args[:2]
    weight, bias, eps = _kwarg(node, 2, "weight"), _kwarg(node, 3, "bias"), _kwarg(node, 4, "eps", 1e-5)
    return _layer_norm(b, src, normalized_shape, weight, bias, eps, True)[0]


@REGISTRY.register(aten.rms_norm.default, supports=lambda n: float_only(n.args[0]) or _static_normalized(n))
def _rms_norm(b, node):
    """x * rsqrt(mean(x^2 over normalized_shape) + eps) * weight, in float32 for the half types and
    rounded once (eps None: float32's machine epsilon, torch's default for these dtypes). Over the
    last axis alone it is one RmsNormNode unless fusion is off."""
    src, normalized_shape = node.args[:2]
    weight, eps = _kwarg(node, 2, "weight"), _kwarg(node, 3, "eps")
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    eps = float(torch.finfo(compute).eps if eps is None else eps)
    x = b.operand(src, compute)
    w = None if weight is None else b.operand(weight, compute)
    if b.fuse and len(normalized_shape) == 1:
        fields = dict(x=x, eps=eps) if w is None else dict(x=x, eps=eps, weight=w)
        return b.cast(b.op("RmsNormNode", **fields), compute, dtype)
    rank = ndim(src)
    axes = list(range(rank - len(normalized_shape), rank))
    ms = b.op("ReduceNode", op=ReduceOp.Mean, x=b.op("UnaryNode", op=UnaryOp.Square, x=x), axes=axes, keepdims=True)
    rstd = b.op("UnaryNode", op=UnaryOp.Rsqrt, x=b.op("BinaryNode", op=BinaryOp.Add, a=ms, b=b.full(eps, compute)))
    out = b.op("BinaryNode", op=BinaryOp.Multiply, a=x, b=rstd)
    if w is not None:
        out = b.op("BinaryNode", op=BinaryOp.Multiply, a=out, b=w)
    return b.cast(out, compute, dtype)


def _batch_norm_supported(node):
    reason = float_only(node.args[0])
    if reason:
        return reason
    if ndim(node.args[0]) < 2:
        return "batch norm needs a channel axis"
    if not _only_output_used(node):
        return "batch norm's saved mean / invstd outputs are not supported"
    return None


@REGISTRY.register(aten._native_batch_norm_legit_no_training.default, supports=_batch_norm_supported)
def _batch_norm(b, node):
    """Inference batch norm over axis 1: x * a + (bias - mean * a), a = weight * rsqrt(var + eps), as
    torch's CPU kernel computes it (float32 for the half types, rounded once)."""
    src, weight, bias, mean, var = node.args[:5]
    eps = node.args[6] if len(node.args) > 6 else node.kwargs.get("eps", 1e-5)
    dtype = src.meta["val"].dtype
    compute = torch.float32 if half_type(dtype) else dtype
    shape = [-1] + [1] * (ndim(src) - 2)

    def channel(arg):
        return b.op("ReshapeNode", x=b.operand(arg, compute), shape=shape)

    a = b.op("UnaryNode", op=UnaryOp.Rsqrt,
             x=b.op("BinaryNode", op=BinaryOp.Add, a=channel(var), b=b.full(eps, compute)))
    if weight is not None:
        a = b.op("BinaryNode", op=BinaryOp.Multiply, a=a, b=channel(weight))
    shift = b.op("UnaryNode", op=UnaryOp.Neg, x=b.op("BinaryNode", op=BinaryOp.Multiply, a=channel(mean), b=a))
    if bias is not None:
        shift = b.op("BinaryNode", op=BinaryOp.Add, a=channel(bias), b=shift)
    out = b.op("BinaryNode", op=BinaryOp.Multiply, a=b.operand(src, compute), b=a)
    out = b.op("BinaryNode", op=BinaryOp.Add, a=out, b=shift)
    return (b.cast(out, compute, dtype), None, None)
