"""Reductions (sum, mean, prod, amax/max, amin/min, any, all, logsumexp, var/std), argmax/argmin,
max.dim/min.dim and cumsum.

Half-precision inputs accumulate in float32, as PyTorch does, and are cast back.
"""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, half_type, ndim, norm_axis, out_dtype
from backends.mlx.serialization.generated.fb.ArgReduceOp import ArgReduceOp
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.ReduceOp import ReduceOp
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp


def _axes(node, dim_arg):
    rank = ndim(node.args[0])
    if dim_arg is None or (isinstance(dim_arg, (list, tuple)) and len(dim_arg) == 0):
        return list(range(rank))
    dims = dim_arg if isinstance(dim_arg, (list, tuple)) else [dim_arg]
    return [norm_axis(d, rank) for d in dims]


def _reduce(b, node, op, dim_arg, keepdim):
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    x = b.operand(node.args[0], compute)
    axes = _axes(node, dim_arg)
    if not axes:  # 0-d input: nothing to reduce, but keep the op's dtype
        return b.cast(x, compute, dtype) if compute != dtype else b.op("CopyNode", x=x)
    out = b.op("ReduceNode", op=op, x=x, axes=axes, keepdims=bool(keepdim))
    return b.cast(out, compute, dtype)


def _arg(node, i, default=None):
    if len(node.args) > i:
        return node.args[i]
    return default


def _reducer(op, dim_index=1, keep_index=2):
    def handler(b, node):
        dim = node.kwargs.get("dim", _arg(node, dim_index))
        keep = node.kwargs.get("keepdim", _arg(node, keep_index, False))
        return _reduce(b, node, op, dim, keep)

    return handler


REGISTRY.register(aten.sum.dim_IntList)(_reducer(ReduceOp.Sum))
REGISTRY.register(aten.sum.default)(lambda b, node: _reduce(b, node, ReduceOp.Sum, None, False))
REGISTRY.register(aten.mean.dim)(_reducer(ReduceOp.Mean))
REGISTRY.register(aten.mean.default)(lambda b, node: _reduce(b, node, ReduceOp.Mean, None, False))
REGISTRY.register(aten.prod.dim_int)(_reducer(ReduceOp.Prod))
REGISTRY.register(aten.prod.default)(lambda b, node: _reduce(b, node, ReduceOp.Prod, None, False))
REGISTRY.register(aten.amax.default)(_reducer(ReduceOp.Max))
REGISTRY.register(aten.amin.default)(_reducer(ReduceOp.Min))
REGISTRY.register(aten.any.dim, aten.any.dims)(_reducer(ReduceOp.Any))
REGISTRY.register(aten.any.default)(lambda b, node: _reduce(b, node, ReduceOp.Any, None, False))
REGISTRY.register(aten.all.dim, aten.all.dims)(_reducer(ReduceOp.All))
REGISTRY.register(aten.all.default)(lambda b, node: _reduce(b, node, ReduceOp.All, None, False))
REGISTRY.register(aten.logsumexp.default)(_reducer(ReduceOp.LogSumExp))
REGISTRY.register(aten.max.default)(lambda b, node: _reduce(b, node, ReduceOp.Max, None, False))
REGISTRY.register(aten.min.default)(lambda b, node: _reduce(b, node, ReduceOp.Min, None, False))


def _extreme_with_index(op, arg_op):
    def handler(b, node):
        """(values, indices) along dim: a reduce and an arg-reduce (the first index of the extreme)."""
        src, dim = node.args[:2]
        keep = bool(node.kwargs.get("keepdim", _arg(node, 2, False)))
        axis = norm_axis(dim, max(ndim(src), 1))
        if ndim(src) == 0:
            return (b.op("CopyNode", x=b.tid(src)), b.full(0, torch.int64))
        values = b.op("ReduceNode", op=op, x=b.tid(src), axes=[axis], keepdims=keep)
        index = b.op("ArgReduceNode", op=arg_op, x=b.tid(src), axis=axis, keepdims=keep)
        return (values, b.op("AsTypeNode", x=index, dtype=_int64()))

    return handler


def _arg_reduce(op):
    def handler(b, node):
        src = node.args[0]
        dim = node.kwargs.get("dim", _arg(node, 1))
        keep = bool(node.kwargs.get("keepdim", _arg(node, 2, False)))
        x = b.tid(src)
        if dim is None:  # over the flattened tensor
            x = b.op("ReshapeNode", x=x, shape=[-1])
            axis = 0
            out = b.op("ArgReduceNode", op=op, x=x, axis=axis, keepdims=False)
            if keep:
                out = b.op("ReshapeNode", x=out, shape=[1] * ndim(src))
        else:
            out = b.op("ArgReduceNode", op=op, x=x, axis=norm_axis(dim, max(ndim(src), 1)), keepdims=keep)
        return b.op("AsTypeNode", x=out, dtype=_int64())

    return handler


def _int64():
    from backends.mlx.exporter.dtypes import to_schema

    return to_schema(torch.int64)


def _not_empty(node):
    return None if node.args[0].meta["val"].numel() != 0 else "argmax/argmin of an empty tensor"


REGISTRY.register(aten.argmax.default, supports=_not_empty)(_arg_reduce(ArgReduceOp.ArgMax))
REGISTRY.register(aten.argmin.default, supports=_not_empty)(_arg_reduce(ArgReduceOp.ArgMin))


@REGISTRY.register(aten.cumsum.default)
def _cumsum(b, node):
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    src = node.args[0]
    x = b.operand(src, compute)
    axis = norm_axis(node.args[1], max(ndim(src), 1))
    if ndim(src) == 0:
        return b.cast(x, compute, dtype)
    out = b.op("CumsumNode", x=x, axis=axis, reverse=False, inclusive=True)
    return b.cast(out, compute, dtype)


REGISTRY.register(aten.max.dim, supports=_not_empty)(_extreme_with_index(ReduceOp.Max, ArgReduceOp.ArgMax))
REGISTRY.register(aten.min.dim, supports=_not_empty)(_extreme_with_index(ReduceOp.Min, ArgReduceOp.ArgMin))


def _var_args(node):
    """(dims, correction, keepdim) of var.correction / var.dim / std.correction."""
    from backends.mlx.exporter.edge_target import aten_target

    dim = node.kwargs.get("dim", _arg(node, 1))
    keep = bool(node.kwargs.get("keepdim", _arg(node, 3 if aten_target(node.target) is aten.var.dim else 2, False)))
    if aten_target(node.target) is aten.var.dim:
        unbiased = node.kwargs.get("unbiased", _arg(node, 2, True))
        correction = 1 if unbiased else 0
    else:
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction
    return dim, correction, keep


def _var_supported(node):
    dtype = out_dtype(node)
    if not dtype.is_floating_point:
        return f"var / std need floats, got {dtype}"
    dim, _, _ = _var_args(node)
    shape = node.args[0].meta["val"].shape
    if any(not isinstance(shape[a], int) for a in _axes(node, dim)):
        return "var / std over a symbolic size"
    return None


def _variance(b, node):
    """sum((x - mean)^2) / (N - correction) in float32 for the half types (N - correction <= 0
    divides by 0, giving inf or nan as torch does)."""
    dim, correction, keep = _var_args(node)
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    axes = _axes(node, dim)
    shape = node.args[0].meta["val"].shape
    count = 1
    for a in axes:
        count *= shape[a]
    x = b.operand(node.args[0], compute)
    if not axes:
        axes, x = [0], b.op("ReshapeNode", x=x, shape=[1])
    mean = b.op("ReduceNode", op=ReduceOp.Mean, x=x, axes=axes, keepdims=True)
    centered = b.op("BinaryNode", op=BinaryOp.Subtract, a=x, b=mean)
    squares = b.op("UnaryNode", op=UnaryOp.Square, x=centered)
    total = b.op("ReduceNode", op=ReduceOp.Sum, x=squares, axes=axes, keepdims=keep)
    if ndim(node.args[0]) == 0:
        total = b.op("ReshapeNode", x=total, shape=[])
    var = b.op("BinaryNode", op=BinaryOp.Divide, a=total, b=b.full(max(count - correction, 0), compute))
    return var, compute, dtype


@REGISTRY.register(aten.var.correction, aten.var.dim, supports=_var_supported)
def _var(b, node):
    var, compute, dtype = _variance(b, node)
    return b.cast(var, compute, dtype)


@REGISTRY.register(aten.std.correction, supports=_var_supported)
def _std(b, node):
    var, compute, dtype = _variance(b, node)
    return b.cast(b.op("UnaryNode", op=UnaryOp.Sqrt, x=var), compute, dtype)
