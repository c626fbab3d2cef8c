"""Views and layout: view/reshape, permute/transpose, (un)squeeze, expand, slice, cat, sym_size."""

from __future__ import annotations

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, ndim, norm_axis, out_dtype


@REGISTRY.register(aten.view_copy.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(b, node):
    src, size = node.args[:2]
    return b.op("ReshapeNode", x=b.tid(src), shape=[b.int_or_vid(s) for s in size])


@REGISTRY.register(aten.permute_copy.default, aten.permute.default)
def _permute(b, node):
    src, dims = node.args[:2]
    rank = ndim(src)
    return b.op("TransposeNode", x=b.tid(src), perm=[norm_axis(d, rank) for d in dims])


@REGISTRY.register(aten.transpose_copy.int, aten.transpose.int)
def _transpose(b, node):
    src, d0, d1 = node.args[:3]
    rank = ndim(src)
    perm = list(range(rank))
    d0, d1 = norm_axis(d0, rank), norm_axis(d1, rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return b.op("TransposeNode", x=b.tid(src), perm=perm)


@REGISTRY.register(aten.t_copy.default, aten.t.default)
def _t(b, node):
    src = node.args[0]
    if ndim(src) < 2:
        return b.op("CopyNode", x=b.tid(src))
    return b.op("TransposeNode", x=b.tid(src), perm=[1, 0])


@REGISTRY.register(aten.unsqueeze_copy.default, aten.unsqueeze.default)
def _unsqueeze(b, node):
    src, dim = node.args[:2]
    return b.op("ExpandDimsNode", x=b.tid(src), axis=norm_axis(dim, ndim(src) + 1))


def _squeeze_dims(node):
    src = node.args[0]
    shape = src.meta["val"].shape
    rank = len(shape)
    if len(node.args) > 1:
        dims = node.args[1]
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
    else:
        dims = range(rank)
    return [norm_axis(d, max(rank, 1)) for d in dims if rank and shape[norm_axis(d, rank)] == 1]


def _squeeze_static(node):
    """Only the dims squeeze may drop must be static (whether a symbolic dim is 1 is unknown); others may not."""
    shape = node.args[0].meta["val"].shape
    dims = node.args[1] if len(node.args) > 1 else range(len(shape))
    dims = dims if isinstance(dims, (list, tuple, range)) else [dims]
    if any(not isinstance(shape[norm_axis(d, len(shape))], int) for d in dims if shape):
        return "squeeze of a symbolic dim is not supported"
    return None


@REGISTRY.register(aten.squeeze_copy.dims, aten.squeeze_copy.dim, aten.squeeze_copy.default,
                   aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, supports=_squeeze_static)
def _squeeze(b, node):
    axes = _squeeze_dims(node)
    if not axes:
        return b.op("CopyNode", x=b.tid(node.args[0]))
    return b.op("SqueezeNode", x=b.tid(node.args[0]), axes=axes)


@REGISTRY.register(aten.expand_copy.default, aten.expand.default)
def _expand(b, node):
    src, size = node.args[:2]
    in_shape = list(src.meta["val"].shape)
    lead = len(size) - len(in_shape)
    shape = []
    for i, s in enumerate(size):
        if isinstance(s, int) and s == -1:
            s = in_shape[i - lead]
        shape.append(b.int_or_vid(s))
    return b.op("BroadcastToNode", x=b.tid(src), shape=shape)


@REGISTRY.register(aten.slice_copy.Tensor, aten.slice.Tensor)
def _slice(b, node):
    args = list(node.args) + [None] * 5
    src = args[0]
    dim = node.kwargs.get("dim", args[1] if args[1] is not None else 0)
    start = node.kwargs.get("start", args[2])
    end = node.kwargs.get("end", args[3])
    step = node.kwargs.get("step", args[4] if args[4] is not None else 1)
    big = 2**62
    return b.op("SliceNode", x=b.tid(src), axis=norm_axis(dim, ndim(src)),
                start=b.int_or_vid(0 if start is None else start),
                stop=b.int_or_vid(big if end is None else min(end, big) if isinstance(end, int) else end),
                step=int(step))


@REGISTRY.register(aten.cat.default, aten.concat.default)
def _cat(b, node):
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dtype = out_dtype(node)
    parts = [b.operand(t, dtype) for t in tensors]
    return b.op("ConcatNode", xs=parts, axis=norm_axis(dim, ndim(tensors[0])))


@REGISTRY.register(aten.sym_size.int)
def _sym_size(b, node):
    src, dim = node.args[:2]
    out = b.new_value()
    b.emit("SymSizeNode", x=b.tid(src), axis=norm_axis(dim, ndim(src)), out=out)
    return out


@REGISTRY.register(aten.split_with_sizes_copy.default, aten.split_with_sizes.default,
                   aten.split.Tensor)
def _split(b, node):
    """Consecutive slices along one axis (split.Tensor's single size repeats, the last may be short)."""
    src, sizes = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    axis = norm_axis(dim, ndim(src))
    total = src.meta["val"].shape[axis]
    if isinstance(sizes, int):
        sizes = [min(sizes, total - start) for start in range(0, total, sizes)]
    outs, start = [], 0
    for size in sizes:
        outs.append(b.op("SliceNode", x=b.tid(src), axis=axis, start=start, stop=start + size))
        start += size
    return tuple(outs)
