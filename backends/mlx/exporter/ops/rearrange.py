"""Ops that copy elements into a new arrangement: constant_pad_nd, stack, repeat,
repeat_interleave, roll, slice_scatter, tril / triu."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, ndim, norm_axis, out_dtype, resolvable_dims
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.ScatterMode import ScatterMode

_END = 2**62  # a slice stop past any size


def _shape(arg):
    return list(arg.meta["val"].shape)


def _static_axes(arg, axes, what):
    shape = _shape(arg)
    if any(not isinstance(shape[a], int) for a in axes):
        return f"{what} needs static sizes on the axes it works along"
    return None


def _pad_value_ok(node):
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    dtype = out_dtype(node)
    if not dtype.is_floating_point and float(value) != int(value):
        return f"pad value {value} does not fit {dtype}"
    return None


@REGISTRY.register(aten.constant_pad_nd.default, supports=_pad_value_ok)
def _constant_pad(b, node):
    """pad = (last axis low, last axis high, next-to-last low, ...); negative widths crop."""
    src, pad = node.args[:2]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    rank = ndim(src)
    x = b.tid(src)
    axes, low, high = [], [], []
    for i in range(len(pad) // 2):
        axis, lo, hi = rank - 1 - i, pad[2 * i], pad[2 * i + 1]
        if lo < 0 or hi < 0:
            x = b.op("SliceNode", x=x, axis=axis, start=max(-lo, 0), stop=hi if hi < 0 else _END)
        if lo > 0 or hi > 0:
            axes.append(axis)
            low.append(max(lo, 0))
            high.append(max(hi, 0))
    if not axes:
        return b.op("CopyNode", x=x)
    return b.op("PadNode", x=x, axes=axes, low=low, high=high, value=float(value))


@REGISTRY.register(aten.stack.default)
def _stack(b, node):
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dtype = out_dtype(node)
    axis = norm_axis(dim, ndim(tensors[0]) + 1)
    parts = [b.op("ExpandDimsNode", x=b.operand(t, dtype), axis=axis) for t in tensors]
    return b.op("ConcatNode", xs=parts, axis=axis)


def _repeat_supported(node):
    src, repeats = node.args[:2]
    shape = _shape(src)
    lead = len(repeats) - len(shape)
    for r, s in zip(repeats[lead:], shape):
        if r != 1 and not isinstance(s, int):
            return "repeat of a symbolic size"
    return None if resolvable_dims(shape) else "repeat of sizes that are expressions of symbolic sizes"


@REGISTRY.register(aten.repeat.default, supports=_repeat_supported)
def _repeat(b, node):
    """Tile: view x as [1, s0, 1, s1, ...], broadcast to [r0, s0, r1, s1, ...], merge the pairs."""
    src, repeats = node.args[:2]
    shape = [1] * (len(repeats) - ndim(src)) + _shape(src)
    pairs, tiled, merged = [], [], []
    for r, s in zip(repeats, shape):
        pairs += [1, b.int_or_vid(s)]
        tiled += [r, b.int_or_vid(s)]
        merged.append(b.int_or_vid(s) if r == 1 else r * s)
    x = b.op("ReshapeNode", x=b.tid(src), shape=pairs)
    x = b.op("BroadcastToNode", x=x, shape=tiled)
    return b.op("ReshapeNode", x=x, shape=merged)


def _repeat_interleave_supported(node):
    src = node.args[0]
    if not isinstance(node.args[1], int):
        return "repeat_interleave with a tensor of repeats"
    return None if all(isinstance(s, int) for s in _shape(src)) else "repeat_interleave of a symbolic size"


@REGISTRY.register(aten.repeat_interleave.self_int, supports=_repeat_interleave_supported)
def _repeat_interleave(b, node):
    """Each element r times in a row along dim (the flattened tensor when dim is None)."""
    src, repeats = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    x, shape = b.tid(src), _shape(src)
    if dim is None:
        x, shape, dim = b.op("ReshapeNode", x=x, shape=[-1]), [max(1, src.meta["val"].numel())], 0
    axis = norm_axis(dim, max(len(shape), 1))
    x = b.op("ExpandDimsNode", x=x, axis=axis + 1)
    x = b.op("BroadcastToNode", x=x, shape=shape[:axis + 1] + [repeats] + shape[axis + 1:])
    return b.op("ReshapeNode", x=x, shape=shape[:axis] + [shape[axis] * repeats] + shape[axis + 1:])


def _roll_supported(node):
    src = node.args[0]
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    axes = [norm_axis(d, ndim(src)) for d in dims] if dims else list(range(ndim(src)))
    return _static_axes(src, axes, "roll")


@REGISTRY.register(aten.roll.default, supports=_roll_supported)
def _roll(b, node):
    """Along each axis: the last `shift` elements moved to the front (two slices, one concat)."""
    src, shifts = node.args[:2]
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    x, shape = b.tid(src), _shape(src)
    if not dims:  # over the flattened tensor, then back
        x = b.op("ReshapeNode", x=x, shape=[-1])
        out = _roll_axis(b, x, shifts[0], 0, src.meta["val"].numel())
        return b.op("ReshapeNode", x=out, shape=[b.int_or_vid(s) for s in shape])
    for shift, dim in zip(shifts, dims):
        axis = norm_axis(dim, len(shape))
        x = _roll_axis(b, x, shift, axis, shape[axis])
    return x if len(dims) else b.op("CopyNode", x=x)


def _roll_axis(b, x, shift, axis, size):
    shift = shift % size if size else 0
    if shift == 0:
        return b.op("CopyNode", x=x)
    tail = b.op("SliceNode", x=x, axis=axis, start=size - shift, stop=size)
    head = b.op("SliceNode", x=x, axis=axis, start=0, stop=size - shift)
    return b.op("ConcatNode", xs=[tail, head], axis=axis)


def _slice_scatter_args(node):
    args = list(node.args) + [None] * 6
    src, values = args[:2]
    dim = node.kwargs.get("dim", args[2] if args[2] is not None else 0)
    start = node.kwargs.get("start", args[3])
    end = node.kwargs.get("end", args[4])
    step = node.kwargs.get("step", args[5] if args[5] is not None else 1)
    return src, values, dim, start, end, step


def _slice_scatter_supported(node):
    src, values, dim, start, end, step = _slice_scatter_args(node)
    axis = norm_axis(dim, ndim(src))
    if any(v is not None and not isinstance(v, int) for v in (start, end, step)):
        return "slice_scatter with symbolic bounds"
    reason = _static_axes(src, [axis], "slice_scatter")
    if reason:
        return reason
    return None if resolvable_dims(_shape(values)) else "slice_scatter of sizes that are expressions"


@REGISTRY.register(aten.slice_scatter.default, supports=_slice_scatter_supported)
def _slice_scatter(b, node):
    """self with self[start:end:step] along dim replaced by `values`: with step 1, the slices before
    and after around `values`; otherwise a put along the axis at start, start + step, ..."""
    src, values, dim, start, end, step = _slice_scatter_args(node)
    axis = norm_axis(dim, ndim(src))
    size = _shape(src)[axis]
    start, end, _ = slice(start, end, step).indices(size)
    dtype = out_dtype(node)
    vals = b.operand(values, dtype)
    x = b.tid(src)
    if step == 1:
        parts = []
        if start > 0:
            parts.append(b.op("SliceNode", x=x, axis=axis, start=0, stop=start))
        parts.append(vals)
        if end < size:
            parts.append(b.op("SliceNode", x=x, axis=axis, start=max(end, start), stop=size))
        if len(parts) == 1:  # values replace all of self
            return b.op("CopyNode", x=vals)
        return b.op("ConcatNode", xs=parts, axis=axis)
    count = len(range(start, end, step))
    idx = b.op("ArangeNode", start=float(start), stop=float(start + count * step), step=float(step),
               dtype=_int64())
    view = [1] * ndim(src)
    view[axis] = count
    idx = b.op("ReshapeNode", x=idx, shape=view)
    idx = b.op("BroadcastToNode", x=idx, shape=[b.int_or_vid(s) for s in _shape(values)])
    return b.op("PutAlongAxisNode", x=x, indices=idx, values=vals, axis=axis, mode=ScatterMode.Replace)


def _int64():
    from backends.mlx.exporter.dtypes import to_schema

    return to_schema(torch.int64)


def _triangle_supported(node):
    src = node.args[0]
    if ndim(src) < 2:
        return "tril / triu need at least 2 dims"
    return _static_axes(src, [ndim(src) - 2, ndim(src) - 1], "tril / triu")


def _triangle(lower: bool):
    def handler(b, node):
        """Keep x where col - row <= k (tril) or >= k (triu), zeros elsewhere."""
        src = node.args[0]
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        rows, cols = _shape(src)[-2:]
        i64 = _int64()
        row = b.op("ReshapeNode", x=b.op("ArangeNode", start=0.0, stop=float(rows), step=1.0, dtype=i64),
                   shape=[rows, 1])
        col = b.op("ArangeNode", start=0.0, stop=float(cols), step=1.0, dtype=i64)
        offset = b.op("BinaryNode", op=BinaryOp.Subtract, a=col, b=row)
        keep = b.op("BinaryNode", op=BinaryOp.LessEqual if lower else BinaryOp.GreaterEqual, a=offset,
                    b=b.full(k, torch.int64))
        return b.op("WhereNode", cond=keep, x=b.tid(src), y=b.full(0, out_dtype(node)))

    return handler


REGISTRY.register(aten.tril.default, supports=_triangle_supported)(_triangle(True))
REGISTRY.register(aten.triu.default, supports=_triangle_supported)(_triangle(False))
