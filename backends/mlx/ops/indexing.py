"""gather / take_along_dim, index_select, embedding, select, and scatter (replace and add)."""

from __future__ import annotations

from backends.mlx.builder.registry import REGISTRY
from backends.mlx.ops.common import aten, ndim, norm_axis, out_dtype
from backends.mlx.serialization.fb.ScatterMode import ScatterMode


def _shape(arg):
    return list(arg.meta["val"].shape)


def _fit_to(b, tid, have, want, skip_axis):
    """Slice `tid` down to `want` on every axis but skip_axis (gather/scatter allow a smaller index)."""
    for axis, (h, w) in enumerate(zip(have, want)):
        if axis != skip_axis and h != w:
            tid = b.op("SliceNode", x=tid, axis=axis, start=0, stop=w)
    return tid


def _static(node):
    for a in node.all_input_nodes:
        if not all(isinstance(s, int) for s in a.meta["val"].shape):
            return "needs static shapes"
    return None


@REGISTRY.register(aten.gather.default, supports=_static)
def _gather(b, node):
    src, dim, index = node.args[:3]
    axis = norm_axis(dim, max(ndim(src), 1))
    x = _fit_to(b, b.tid(src), _shape(src), _shape(index), axis)
    return b.op("TakeAlongAxisNode", x=x, indices=b.tid(index), axis=axis)


@REGISTRY.register(aten.take_along_dim.default, supports=_static)
def _take_along_dim(b, node):
    src, index = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        flat = b.op("ReshapeNode", x=b.tid(src), shape=[-1])
        idx = b.op("ReshapeNode", x=b.tid(index), shape=[-1])
        return b.op("TakeAlongAxisNode", x=flat, indices=idx, axis=0)
    axis = norm_axis(dim, max(ndim(src), 1))
    return b.op("TakeAlongAxisNode", x=b.tid(src), indices=b.tid(index), axis=axis)


@REGISTRY.register(aten.index_select.default)
def _index_select(b, node):
    src, dim, index = node.args[:3]
    return b.op("TakeNode", x=b.tid(src), indices=b.tid(index), axis=norm_axis(dim, max(ndim(src), 1)))


@REGISTRY.register(aten.embedding.default)
def _embedding(b, node):
    weight, indices = node.args[:2]
    return b.op("TakeNode", x=b.tid(weight), indices=b.tid(indices), axis=0)


@REGISTRY.register(aten.select_copy.int, aten.select.int)
def _select(b, node):
    src, dim, index = node.args[:3]
    axis = norm_axis(dim, ndim(src))
    start = b.int_or_vid(index)
    if start[0] == "lit" and start[1] < 0:
        size = src.meta["val"].shape[axis]
        start = ("lit", start[1] + int(size))
    stop = ("lit", start[1] + 1) if start[0] == "lit" else None
    if stop is None:
        raise ValueError("select with a symbolic index is not supported")
    sl = b.op("SliceNode", x=b.tid(src), axis=axis, start=start, stop=stop)
    return b.op("SqueezeNode", x=sl, axes=[axis])


def _scatter_supported(node):
    reason = _static(node)
    if reason:
        return reason
    src, dim, index = node.args[:3]
    axis = norm_axis(dim, max(ndim(src), 1))
    for a, (s, i) in enumerate(zip(_shape(src), _shape(index))):
        if a != axis and s != i:
            return "scatter with an index smaller than self off the scatter axis is not supported"
    if "reduce" in node.kwargs or len(node.args) > 4:
        return "scatter with `reduce` is not supported"
    return None


def _scatter(mode):
    def handler(b, node):
        src, dim, index, values = node.args[:4]
        axis = norm_axis(dim, max(ndim(src), 1))
        dtype = out_dtype(node)
        if hasattr(values, "meta"):
            vals = _fit_to(b, b.operand(values, dtype), _shape(values), _shape(index), -1)
        else:
            vals = b.full(values, dtype)
        return b.op("PutAlongAxisNode", x=b.tid(src), indices=b.tid(index), values=vals, axis=axis, mode=mode)

    return handler


REGISTRY.register(aten.scatter.src, aten.scatter.value, supports=_scatter_supported)(_scatter(ScatterMode.Replace))
REGISTRY.register(aten.scatter_add.default, supports=_scatter_supported)(_scatter(ScatterMode.Add))
