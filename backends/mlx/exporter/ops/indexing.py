"""gather / take_along_dim, index_select, embedding, select, and scatter (replace and add)."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, ndim, norm_axis, out_dtype, resolvable_dims
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.ScatterMode import ScatterMode


def _shape(arg):
    return list(arg.meta["val"].shape)


def _fit_to(b, tid, have, want, skip_axis):
    """Slice `tid` down to `want` on every axis but skip_axis (gather/scatter allow a smaller index)."""
    for axis, (h, w) in enumerate(zip(have, want)):
        if axis != skip_axis and not _same_size(h, w):
            tid = b.op("SliceNode", x=tid, axis=axis, start=0, stop=w)
    return tid


def _same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def _static(node):
    """Sizes the runtime can read (literals or input dimensions); where self and index differ off
    the indexed axis the handler slices, which needs literal sizes."""
    for a in node.all_input_nodes:
        if not resolvable_dims(a.meta["val"].shape):
            return "sizes that are expressions of symbolic sizes"
    src, index = node.args[0], node.args[-1] if node.target is aten.take_along_dim.default else node.args[2]
    dim = node.args[1] if node.target is not aten.take_along_dim.default else (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("dim"))
    if dim is None:
        return None
    axis = norm_axis(dim, max(ndim(src), 1))
    for i, (s, w) in enumerate(zip(_shape(src), _shape(index))):
        if i != axis and not _same_size(s, w) and not (isinstance(s, int) and isinstance(w, int)):
            return "self and index differ in a symbolic size off the indexed axis"
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
    if start[0] != "lit":
        raise ValueError("select with a symbolic index is not supported")
    # A negative index stays negative: the runtime counts it from the actual size (which may be dynamic).
    stop = ("lit", 2**62) if start[1] == -1 else ("lit", start[1] + 1)
    sl = b.op("SliceNode", x=b.tid(src), axis=axis, start=start, stop=stop)
    return b.op("SqueezeNode", x=sl, axes=[axis])


def _scatter_supported(node):
    reason = _static(node)
    if reason:
        return reason
    src, dim, index = node.args[:3]
    axis = norm_axis(dim, max(ndim(src), 1))
    for a, (s, i) in enumerate(zip(_shape(src), _shape(index))):
        if a != axis and not _same_size(s, i):
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


def _index_supported(node):
    src, indices = node.args[:2]
    present = [i for i, t in enumerate(indices) if t is not None]
    if not present:
        return "indexing without an index tensor"
    if any(indices[i].meta["val"].dtype not in (torch.int32, torch.int64) for i in present):
        return "boolean-mask indexing is not supported"
    if len(present) > 1:
        if present != list(range(len(present))):
            return "several index tensors must be the leading dims, with no gaps"
        if not all(isinstance(d, int) for d in src.meta["val"].shape[: len(present)]):
            return "several index tensors need static sizes on the indexed dims"
    return None


def _wrapped(b, idx_tid, size):
    """Negative indices count from the end, as in PyTorch."""
    i64 = torch.int64
    negative = b.op("BinaryNode", op=BinaryOp.Less, a=idx_tid, b=b.full(0, i64))
    return b.op("WhereNode", cond=negative, x=b.op("BinaryNode", op=BinaryOp.Add, a=idx_tid, b=b.full(size, i64)),
                y=idx_tid)


@REGISTRY.register(aten.index.Tensor, supports=_index_supported)
def _index(b, node):
    """x[i0, i1, ..., :] with integer index tensors.

    One index tensor (any dim): a take along that axis. Several leading ones: they broadcast
    together and become one flat index into x viewed as [prod(indexed dims), rest...]."""
    src, indices = node.args[:2]
    present = [i for i, t in enumerate(indices) if t is not None]
    if len(present) == 1:
        axis = present[0]
        return b.op("TakeNode", x=b.tid(src), indices=b.tid(indices[axis]), axis=axis)
    shape = list(src.meta["val"].shape)
    k = len(present)
    flat = None
    for d in range(k):
        idx = _wrapped(b, b.operand(indices[d], torch.int64), shape[d])
        stride = 1
        for s in shape[d + 1:k]:
            stride *= s
        term = idx if stride == 1 else b.op("BinaryNode", op=BinaryOp.Multiply, a=idx, b=b.full(stride, torch.int64))
        flat = term if flat is None else b.op("BinaryNode", op=BinaryOp.Add, a=flat, b=term)
    lead = 1
    for s in shape[:k]:
        lead *= s
    view = b.op("ReshapeNode", x=b.tid(src), shape=[lead, *[b.int_or_vid(s) for s in shape[k:]]])
    return b.op("TakeNode", x=view, indices=flat, axis=0)


def _index_copy_supported(node):
    src, dim, index, source = node.args[:4]
    if index.meta["val"].dim() != 1:
        return "index_copy needs a 1-d index"
    if not resolvable_dims(source.meta["val"].shape):
        return "index_copy with sizes that are expressions of symbolic sizes"
    return None


@REGISTRY.register(aten.index_copy.default, supports=_index_copy_supported)
def _index_copy(b, node):
    """self with source's slices written at `index` along dim (a KV-cache update): a put along the axis
    with the 1-d index broadcast to source's shape."""
    src, dim, index, source = node.args[:4]
    rank = ndim(src)
    axis = norm_axis(dim, max(rank, 1))
    shape = [b.int_or_vid(s) for s in source.meta["val"].shape]
    view = [1] * rank
    view[axis] = -1
    idx = b.op("ReshapeNode", x=b.tid(index), shape=view)
    idx = b.op("BroadcastToNode", x=idx, shape=shape)
    return b.op("PutAlongAxisNode", x=b.tid(src), indices=idx, values=b.operand(source, out_dtype(node)), axis=axis,
                mode=ScatterMode.Replace)
