"""RMSNorm written out in aten ops -> one RmsNormNode (mlx::core::fast::rms_norm).

The core is `n = h * rsqrt(mean(h^2, last axis, keepdim) + eps)` with h float32 and
eps a constant. MLX's kernel normalizes in float32, rounds to its result dtype T,
then multiplies by the weight in T, so three spellings map onto it exactly:

  * Llama / Qwen (`weight * n.to(x.dtype)`, h = x.float()): rms_norm(x, weight) in x's
    dtype, when the weight has that dtype too;
  * a cast back without weight (`n.to(x.dtype)`): rms_norm(x) in x's dtype;
  * torch.nn.RMSNorm's decomposition (`n * weight`, weight float32, cast afterwards):
    rms_norm(h, weight) in float32, the cast left as it is; likewise n alone.

A core computed in a half dtype is not claimed: the kernel would round less often
than the graph does. On the CPU device the result is the graph's bit for bit (MLX
composes the same float32 ops; the mean is a float32 sum in both).
"""

from __future__ import annotations

from typing import Optional

import torch

from backends.mlx.exporter.fusion.graph_match import (Constants, aten, binary_operands, cast_source, dtype, is_op, last_axis,
                                             only_user, same_shape, same_size, shape, users_within)
from backends.mlx.exporter.fusion.pattern import Fusion


def _core(n) -> Optional[tuple]:
    """(h, eps_arg, interior nodes) when n = h * rsqrt(mean(h^2) + eps) over h's last axis."""
    ops = binary_operands(n, aten.mul.Tensor)
    if ops is None:
        return None
    for h, r in (ops, ops[::-1]):
        if is_op(r, aten.rsqrt.default) and only_user(r) is n and isinstance(h, torch.fx.Node):
            break
    else:
        return None
    s = r.args[0]
    ops = binary_operands(s, aten.add.Tensor, aten.add.Scalar)
    if ops is None or only_user(s) is not r:
        return None
    for m, eps in (ops, ops[::-1]):
        if is_op(m, aten.mean.dim):
            break
    else:
        return None
    if only_user(m) is not s or len(m.args) < 3 or m.args[2] is not True or m.kwargs.get("dtype") is not None:
        return None
    dims, p = m.args[1], m.args[0]
    rank = len(shape(h) or ())
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not last_axis(dims[0], rank):
        return None
    squares_h = (is_op(p, aten.pow.Tensor_Scalar) and p.args[0] is h and p.args[1] == 2) or (
        is_op(p, aten.mul.Tensor) and p.args[0] is h and p.args[1] is h)
    if not squares_h or only_user(p) is not m:
        return None
    if any(dtype(t) != torch.float32 for t in (h, p, m, s, r, n)):
        return None
    return h, eps, {p, m, s, r}


def _weight_of(mul, y) -> Optional[torch.fx.Node]:
    """The other operand of `mul` = y * w when w is 1-d over y's last axis in y's dtype."""
    ops = binary_operands(mul, aten.mul.Tensor)
    if ops is None:
        return None
    w = ops[1] if ops[0] is y else ops[0] if ops[1] is y else None
    if not isinstance(w, torch.fx.Node) or w is y:
        return None
    ws, ys = shape(w), shape(y)
    if ws is None or len(ws) != 1 or not same_size(ws[0], ys[-1]):
        return None
    if dtype(w) != dtype(y) or dtype(mul) != dtype(y) or not same_shape(shape(mul), ys):
        return None
    return w


def match_rms_norm(n, consts: Constants) -> Optional[Fusion]:
    core = _core(n)
    if core is None:
        return None
    h, eps_arg, interior = core
    eps = consts.scalar(eps_arg)
    if eps is None:
        return None
    x = cast_source(h)
    if x is not None and dtype(x) not in (torch.float16, torch.bfloat16):
        x = None
    root, x_in, weight = n, h, None
    out = only_user(n)
    if out is not None and x is not None and cast_source(out) is n and dtype(out) == dtype(x):
        # Cast back to x's dtype (Llama): the kernel takes x as it is and rounds where the graph does.
        interior.add(n)
        root, x_in = out, x
        after = only_user(out)
        weight = _weight_of(after, out) if after is not None else None
        if weight is not None:
            interior.add(out)
            root = after
    elif out is not None:
        weight = _weight_of(out, n)
        if weight is not None:
            interior.add(n)
            root = out
    if x_in is x and users_within(h, interior | {n}):
        interior.add(h)
    return Fusion("RmsNormNode", root, frozenset(interior), _emitter(x_in, weight, float(eps)))


def _emitter(x, weight, eps):
    def emit(b):
        fields = dict(x=b.tid(x), eps=eps)
        if weight is not None:
            fields["weight"] = b.tid(weight)
        return b.op("RmsNormNode", **fields)

    return emit
