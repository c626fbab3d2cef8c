"""sort, argsort and topk.

Descending order sorts the negated keys, which keeps PyTorch's stable tie order
(a reversed ascending sort would reverse it); so it needs a signed dtype.
topk partitions first and sorts only the k survivors.
"""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.edge_target import aten_target
from backends.mlx.exporter.dtypes import to_schema
from backends.mlx.exporter.ops.common import aten, ndim, norm_axis
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp

_SIGNED = {torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.int16}


def _keys(b, src, descending: bool):
    x = b.tid(src)
    return b.op("UnaryNode", op=UnaryOp.Neg, x=x) if descending else x


def _signed_if_descending(descending_of):
    def check(node):
        if descending_of(node) and node.args[0].meta["val"].dtype not in _SIGNED:
            return f"descending order of {node.args[0].meta['val'].dtype} is not supported"
        return None

    return check


def _sort_args(node):
    target = aten_target(node.target)
    args = list(node.args)
    if target is aten.sort.stable:
        dim = node.kwargs.get("dim", args[2] if len(args) > 2 else -1)
        descending = node.kwargs.get("descending", args[3] if len(args) > 3 else False)
    else:
        dim = node.kwargs.get("dim", args[1] if len(args) > 1 else -1)
        descending = node.kwargs.get("descending", args[2] if len(args) > 2 else False)
    return dim, bool(descending)


def _argsort_to_int64(b, idx):
    return b.op("AsTypeNode", x=idx, dtype=to_schema(torch.int64))


@REGISTRY.register(aten.sort.default, aten.sort.stable,
                   supports=_signed_if_descending(lambda n: _sort_args(n)[1]))
def _sort(b, node):
    src = node.args[0]
    dim, descending = _sort_args(node)
    axis = norm_axis(dim, max(ndim(src), 1))
    idx = b.op("ArgsortNode", x=_keys(b, src, descending), axis=axis)
    values = b.op("TakeAlongAxisNode", x=b.tid(src), indices=idx, axis=axis)
    return (values, _argsort_to_int64(b, idx))


def _argsort_args(node):
    args = list(node.args)
    dim = node.kwargs.get("dim", args[1] if len(args) > 1 else -1)
    descending = node.kwargs.get("descending", args[2] if len(args) > 2 else False)
    return dim, bool(descending)


@REGISTRY.register(aten.argsort.default, supports=_signed_if_descending(lambda n: _argsort_args(n)[1]))
def _argsort(b, node):
    src = node.args[0]
    dim, descending = _argsort_args(node)
    idx = b.op("ArgsortNode", x=_keys(b, src, descending), axis=norm_axis(dim, max(ndim(src), 1)))
    return _argsort_to_int64(b, idx)


def _topk_args(node):
    args = list(node.args) + [None] * 5
    k = args[1]
    dim = node.kwargs.get("dim", args[2] if args[2] is not None else -1)
    largest = node.kwargs.get("largest", args[3] if args[3] is not None else True)
    return k, dim, bool(largest)


def _topk_supported(node):
    k, _, largest = _topk_args(node)
    if not isinstance(k, int):
        return "topk with a symbolic k is not supported"
    return _signed_if_descending(lambda n: largest)(node)


@REGISTRY.register(aten.topk.default, supports=_topk_supported)
def _topk(b, node):
    src = node.args[0]
    k, dim, largest = _topk_args(node)
    rank = max(ndim(src), 1)
    axis = norm_axis(dim, rank)
    size = src.meta["val"].shape[axis] if ndim(src) else 1
    keys = _keys(b, src, largest)
    if k == 0:
        empty_idx = b.op("SliceNode", x=b.op("ArgsortNode", x=keys, axis=axis), axis=axis, start=0, stop=0)
        idx = empty_idx
    else:
        if isinstance(size, int) and k < size:
            part = b.op("ArgPartitionNode", x=keys, kth=k - 1, axis=axis)
            part = b.op("SliceNode", x=part, axis=axis, start=0, stop=k)
        else:
            part = b.op("ArgsortNode", x=keys, axis=axis)
        order = b.op("ArgsortNode", x=b.op("TakeAlongAxisNode", x=keys, indices=part, axis=axis), axis=axis)
        idx = b.op("TakeAlongAxisNode", x=part, indices=order, axis=axis)
    values = b.op("TakeAlongAxisNode", x=b.tid(src), indices=idx, axis=axis)
    return (values, _argsort_to_int64(b, idx))
