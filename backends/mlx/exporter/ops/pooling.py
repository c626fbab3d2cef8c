"""Max and average pooling (1-d pooling exports as the 2-d op), and adaptive average pooling
when every input size is a multiple of its output size.

A pooled result is a combination of prod(kernel) strided slices of the (padded) input, one
per kernel offset: max of them, or their sum over a divisor. The window geometry is fixed
at export, so the spatial sizes must be static (batch and channels may be symbolic); the
average's divisor (the window's count with or without padding, as torch counts it, or
divisor_override) is computed here and stored as a constant.
"""

from __future__ import annotations

import itertools
import operator

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, float_only, half_type, ndim, out_dtype
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp

_MAX = (aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
_AVG = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}


def _spatial_rank(node) -> int:
    from backends.mlx.exporter.edge_target import aten_target

    target = aten_target(node.target)
    if target in _AVG:
        return _AVG[target]
    if target is aten._adaptive_avg_pool2d.default:
        return 2
    return 2 if target is aten.max_pool2d_with_indices.default else 3


def _expand(v, k, default):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * k if len(v) == 1 else v


def _output_size(size, kernel, stride, pad, dilation, ceil_mode):
    """torch's pooling output size along one axis."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _spatial_static(node):
    reason = float_only(node.args[0])
    if reason:
        return reason
    k = _spatial_rank(node)
    src = node.args[0]
    if ndim(src) not in (k + 1, k + 2):
        return f"{k}-d pooling of a {ndim(src)}-d input"
    if not all(isinstance(s, int) for s in src.meta["val"].shape[-k:]):
        return "pooling needs static spatial sizes"
    return None


def _max_supported(node):
    reason = _spatial_static(node)
    if reason:
        return reason
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return "max pooling's indices output is not supported"
    return None


def _windows(b, x, sizes, kernel, stride, dilation, outs, first_axis):
    """The strided slice of x for every kernel offset: window element (j...) of every output."""
    for offsets in itertools.product(*[range(k) for k in kernel]):
        t = x
        for i, j in enumerate(offsets):
            start = j * dilation[i]
            t = b.op("SliceNode", x=t, axis=first_axis + i, start=start, stop=start + (outs[i] - 1) * stride[i] + 1,
                     step=stride[i])
        yield t


def _pad_for(b, x, sizes, pad, kernel, stride, dilation, outs, first_axis, value):
    """x padded by `pad` before each spatial axis and enough after for every window (ceil mode)."""
    low, high = [], []
    for i, size in enumerate(sizes):
        need = (outs[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1
        low.append(pad[i])
        high.append(max(need - size - pad[i], 0))
    if not any(low) and not any(high):
        return x
    return b.op("PadNode", x=x, axes=[first_axis + i for i in range(len(sizes))], low=low, high=high,
                value=float(value))


@REGISTRY.register(*_MAX, supports=_max_supported)
def _max_pool(b, node):
    src = node.args[0]
    k = _spatial_rank(node)
    args = list(node.args) + [None] * 6
    kernel = _expand(args[1], k, None)
    stride = _expand(args[2], k, kernel)
    pad = _expand(args[3] if args[3] is not None else 0, k, 0)
    dilation = _expand(args[4] if args[4] is not None else 1, k, 1)
    ceil_mode = bool(node.kwargs.get("ceil_mode", args[5] or False))
    sizes = list(src.meta["val"].shape[-k:])
    outs = [_output_size(*p, ceil_mode) for p in zip(sizes, kernel, stride, pad, dilation)]
    first = ndim(src) - k
    x = _pad_for(b, b.tid(src), sizes, pad, kernel, stride, dilation, outs, first, float("-inf"))
    out = None
    for w in _windows(b, x, sizes, kernel, stride, dilation, outs, first):
        out = w if out is None else b.op("BinaryNode", op=BinaryOp.Maximum, a=out, b=w)
    return (out, None)


def _avg_divisor(sizes, kernel, stride, pad, outs, count_include_pad, divisor_override):
    """What torch divides each output's window sum by: [*outs] float32."""
    if divisor_override:
        return torch.full(outs, float(divisor_override))
    per_axis = []
    for size, k, s, p, o in zip(sizes, kernel, stride, pad, outs):
        counts = []
        for i in range(o):
            start = i * s - p
            end = min(start + k, size + p)
            counts.append(end - start if count_include_pad else min(end, size) - max(start, 0))
        per_axis.append(torch.tensor(counts, dtype=torch.float64))
    divisor = per_axis[0]
    for axis in per_axis[1:]:
        divisor = divisor[..., None] * axis
    return divisor.to(torch.float32)


def _avg_pool_emit(b, node, kernel, stride, pad, ceil_mode, count_include_pad, divisor_override):
    src = node.args[0]
    k = len(kernel)
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    sizes = list(src.meta["val"].shape[-k:])
    ones = [1] * k
    outs = [_output_size(*p, ceil_mode) for p in zip(sizes, kernel, stride, pad, ones)]
    first = ndim(src) - k
    x = _pad_for(b, b.operand(src, compute), sizes, pad, kernel, stride, ones, outs, first, 0.0)
    total = None
    for w in _windows(b, x, sizes, kernel, stride, ones, outs, first):
        total = w if total is None else b.op("BinaryNode", op=BinaryOp.Add, a=total, b=w)
    divisor = _avg_divisor(sizes, kernel, stride, pad, outs, count_include_pad, divisor_override)
    if bool((divisor == divisor.reshape(-1)[0]).all()):
        d = b.full(float(divisor.reshape(-1)[0]), compute)
    else:
        d = b.cast(b.add_constant(divisor), torch.float32, compute)
    return b.cast(b.op("BinaryNode", op=BinaryOp.Divide, a=total, b=d), compute, dtype)


@REGISTRY.register(*_AVG, supports=_spatial_static)
def _avg_pool(b, node):
    k = _spatial_rank(node)
    args = list(node.args) + [None] * 7
    kernel = _expand(args[1], k, None)
    stride = _expand(args[2], k, kernel)
    pad = _expand(args[3] if args[3] is not None else 0, k, 0)
    ceil_mode = bool(node.kwargs.get("ceil_mode", args[4] or False))
    include = node.kwargs.get("count_include_pad", True if args[5] is None else args[5])
    override = node.kwargs.get("divisor_override", args[6])
    return _avg_pool_emit(b, node, kernel, stride, pad, ceil_mode, bool(include), override)


def _adaptive_supported(node):
    reason = _spatial_static(node)
    if reason:
        return reason
    sizes = node.args[0].meta["val"].shape[-2:]
    if any(s % o for s, o in zip(sizes, node.args[1])):
        return "adaptive average pooling to sizes that do not divide the input's"
    return None


@REGISTRY.register(aten._adaptive_avg_pool2d.default, supports=_adaptive_supported)
def _adaptive_avg_pool(b, node):
    """Each output averages an equal, non-overlapping block: a plain average pool."""
    sizes = node.args[0].meta["val"].shape[-2:]
    kernel = [s // o for s, o in zip(sizes, node.args[1])]
    return _avg_pool_emit(b, node, kernel, kernel, [0, 0], False, True, None)


