"""Dtype casts and copies (_to_copy, the dim-order copy edge emits, clone, alias, copy)."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, out_dtype, resolvable_dims

_dim_order_ops = getattr(torch.ops, "dim_order_ops", None)


def _contiguous_only(node):
    fmt = node.kwargs.get("memory_format")
    if fmt not in (None, torch.contiguous_format, torch.preserve_format):
        return f"memory_format {fmt} is not supported"
    order = node.kwargs.get("dim_order")
    if order is not None and list(order) != sorted(order):
        return f"dim_order {order} is not supported (only contiguous)"
    return None


def _cast(b, node):
    src = node.args[0]
    tid = b.tid(src)
    dst = out_dtype(node)
    if src.meta["val"].dtype == dst:
        return b.op("CopyNode", x=tid)
    return b.cast(tid, src.meta["val"].dtype, dst)


_CASTS = [aten._to_copy.default, aten.clone.default, aten.alias_copy.default]
if _dim_order_ops is not None and hasattr(_dim_order_ops, "_to_dim_order_copy"):
    _CASTS.append(_dim_order_ops._to_dim_order_copy.default)
    _CASTS.append(_dim_order_ops._clone_dim_order.default)
REGISTRY.register(*_CASTS, supports=_contiguous_only)(_cast)


@REGISTRY.register(aten.copy.default, supports=lambda n: None if resolvable_dims(n.args[0].meta["val"].shape)
                   else "copy into sizes that are expressions of symbolic sizes")
def _copy(b, node):
    """copy(self, src) (a functionalized `self.copy_(src)`): src cast to self's dtype and broadcast
    to self's shape."""
    dst, src = node.args[:2]
    x = b.operand(src, out_dtype(node))
    shape = [b.int_or_vid(s) for s in dst.meta["val"].shape]
    return b.op("BroadcastToNode", x=x, shape=shape)
