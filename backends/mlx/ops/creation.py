"""Tensor creation: full, zeros/ones (edge turns them into full), *_like, arange, scalar_tensor."""

from __future__ import annotations

from backends.mlx.builder.registry import REGISTRY, aten_target
from backends.mlx.dtypes import to_schema
from backends.mlx.ops.common import aten, out_dtype, resolvable_shape


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


def _literal_bounds(node):
    if any(not isinstance(a, (int, float)) for a in node.args):
        return "arange with symbolic bounds is not supported yet"
    return None


@REGISTRY.register(aten.arange.start_step, aten.arange.default, aten.arange.start, supports=_literal_bounds)
def _arange(b, node):
    args = list(node.args)
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end = args[:2]
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return b.op("ArangeNode", start=float(start), stop=float(end), step=float(step),
                dtype=to_schema(out_dtype(node)))
