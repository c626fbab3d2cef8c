"""aten.convolution (conv1d/2d/3d and their transposes all export as it) -> one ConvNode.

MLX convolves channels-last: x [N, *spatial, C_in] with w [C_out, *kernel, C_in / groups]. The
handler transposes torch's channels-first operands in and the result back out. A transposed
convolution is the plain one over the input spread by `stride` (input_dilation), with the kernel
flipped and its in/out channels swapped per group, padded by dilation * (k - 1) - padding on both
sides (+ output_padding after); a negative pad becomes a slice of the result.
Half-precision operands are convolved and biased in float32 and rounded once, as torch's CPU
kernels accumulate (MLX's half kernels drift by several ulps on the transposed form).
"""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, float_only, half_type, ndim, out_dtype
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp


def _conv_args(node):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args[:9]
    k = ndim(x) - 2
    expand = (lambda v: list(v) * k if len(v) == 1 else list(v))
    return x, w, bias, expand(stride), expand(padding), expand(dilation), transposed, expand(output_padding), groups


def _supported(node):
    reason = float_only(node)
    if reason:
        return reason
    x, w = node.args[:2]
    if not 3 <= ndim(x) <= 5:
        return f"convolution of a {ndim(x)}-d input (batched 1-d to 3-d expected)"
    if not all(isinstance(s, int) for s in w.meta["val"].shape):
        return "convolution with a symbolic kernel shape"
    if any(not isinstance(s, int) for s in x.meta["val"].shape[1:]):
        return "convolution with symbolic channel or spatial sizes"
    return None


def _perm_to_last(rank):
    return [0, *range(2, rank), 1]


def _perm_to_first(rank):
    return [0, rank - 1, *range(1, rank - 1)]


def _transposed_weight(b, tid, w, groups):
    """torch's [C_in, C_out / g, *k] as [C_out, *k, C_in / g] (flipping is the node's `flip`)."""
    shape = list(w.meta["val"].shape)
    c_in, c_out_g, kernel = shape[0], shape[1], shape[2:]
    t = b.op("ReshapeNode", x=tid, shape=[groups, c_in // groups, c_out_g, *kernel])
    k = len(kernel)
    t = b.op("TransposeNode", x=t, perm=[0, 2, *range(3, 3 + k), 1])
    return b.op("ReshapeNode", x=t, shape=[groups * c_out_g, *kernel, c_in // groups])


@REGISTRY.register(aten.convolution.default, supports=_supported)
def _convolution(b, node):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = _conv_args(node)
    rank = ndim(x)
    dtype = out_dtype(node)
    compute = torch.float32 if half_type(dtype) else dtype
    xt = b.op("TransposeNode", x=b.operand(x, compute), perm=_perm_to_last(rank))
    kernel = list(w.meta["val"].shape[2:])
    crop = None
    if not transposed:
        wt = b.op("TransposeNode", x=b.operand(w, compute), perm=_perm_to_last(rank))
        out = b.op("ConvNode", x=xt, w=wt, stride=stride, padding_lo=padding, padding_hi=padding,
                   kernel_dilation=dilation, input_dilation=[1] * len(kernel), groups=groups, flip=False)
    else:
        lo = [d * (k - 1) - p for d, k, p in zip(dilation, kernel, padding)]
        hi = [low + op for low, op in zip(lo, output_padding)]
        crop = [(max(-low, 0), max(-high, 0)) for low, high in zip(lo, hi)]
        out = b.op("ConvNode", x=xt, w=_transposed_weight(b, b.operand(w, compute), w, groups), stride=[1] * len(kernel),
                   padding_lo=[max(v, 0) for v in lo], padding_hi=[max(v, 0) for v in hi],
                   kernel_dilation=dilation, input_dilation=stride, groups=groups, flip=True)
    if crop is not None:
        for i, (front, back) in enumerate(crop):
            if front or back:
                out = b.op("SliceNode", x=out, axis=1 + i, start=front, stop=-back if back else 2**62)
    out = b.op("TransposeNode", x=out, perm=_perm_to_first(rank))
    if bias is not None:
        shaped = b.op("ReshapeNode", x=b.operand(bias, compute), shape=[-1] + [1] * (rank - 2))
        out = b.op("BinaryNode", op=BinaryOp.Add, a=out, b=shaped)
    return b.cast(out, compute, dtype)
