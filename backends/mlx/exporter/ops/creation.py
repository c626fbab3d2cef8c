"""Tensor creation: full, zeros/ones (edge turns them into full), *_like, arange, scalar_tensor."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.edge_target import aten_target
from backends.mlx.exporter.dtypes import to_schema
from backends.mlx.exporter.ops.common import aten, out_dtype, resolvable_shape


@REGISTRY.register(aten.full.default)
def _full(b, node):
    size, value = node.args[:2]
    shape = [b.int_or_vid(s) for s in size]
    return b.op("FullNode", shape=shape, value=float(value), dtype=to_schema(out_dtype(node)))


@REGISTRY.register(aten.zeros.default, aten.ones.default)
def _zeros_ones(b, node):
    shape = [b.int_or_vid(s) for s in node.args[0]]
    value = 1.0 if aten_target(node.target) is aten.ones.default else 0.0
    return b.op("FullNode", shape=shape, value=value, dtype=to_schema(out_dtype(node)))


def _like_value(node):
    target = aten_target(node.target)
    if target is aten.full_like.default:
        return float(node.args[1])
    return 1.0 if target is aten.ones_like.default else 0.0


@REGISTRY.register(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, supports=resolvable_shape)
def _like(b, node):
    shape = [b.int_or_vid(s) for s in node.meta["val"].shape]
    return b.op("FullNode", shape=shape, value=_like_value(node), dtype=to_schema(out_dtype(node)))


@REGISTRY.register(aten.scalar_tensor.default)
def _scalar_tensor(b, node):
    return b.full(node.args[0], out_dtype(node))


def _bounds(node):
    args = list(node.args)
    return (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else node.kwargs.get("step", 1))


def _literal_or_symbolic_end(node):
    start, end, step = _bounds(node)
    if not isinstance(start, (int, float)) or not isinstance(step, (int, float)):
        return "arange with a symbolic start or step is not supported"
    if isinstance(end, (int, float)):
        return None
    if start != 0 or step != 1:
        return "arange with a symbolic end is supported only from 0 in steps of 1"
    val = end.meta.get("val") if hasattr(end, "meta") else end
    if not (isinstance(val, torch.SymInt) and val.node.expr.is_Symbol):
        return "arange whose end is an expression of symbolic sizes is not supported"
    return None


@REGISTRY.register(aten.arange.start_step, aten.arange.default, aten.arange.start, supports=_literal_or_symbolic_end)
def _arange(b, node):
    start, end, step = _bounds(node)
    dtype = out_dtype(node)
    if isinstance(end, (int, float)):
        return b.op("ArangeNode", start=float(start), stop=float(end), step=float(step), dtype=to_schema(dtype))
    # 0..n-1 for a run-time n (a dynamic input size): an exclusive running sum of n ones.
    ones = b.op("FullNode", shape=[b.int_or_vid(end)], value=1.0, dtype=to_schema(dtype))
    return b.op("CumsumNode", x=ones, axis=0, reverse=False, inclusive=False)


_EMPTY = [aten.empty.memory_format]
if hasattr(getattr(torch.ops, "dim_order_ops", None), "_empty_dim_order"):
    _EMPTY.append(torch.ops.dim_order_ops._empty_dim_order.default)


@REGISTRY.register(*_EMPTY, supports=resolvable_shape)
def _empty(b, node):
    """An uninitialized tensor (DeepSeek's attention fills one slice by slice): zeros, a valid 'anything'."""
    shape = [b.int_or_vid(s) for s in node.meta["val"].shape]
    return b.op("FullNode", shape=shape, value=0.0, dtype=to_schema(out_dtype(node)))
