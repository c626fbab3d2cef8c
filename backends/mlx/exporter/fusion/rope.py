"""Rotate-half rotary embedding -> one RopeNode.

The pattern (Llama, Qwen, GPT-NeoX style `apply_rotary_pos_emb`):

    out = x * cos + cat([-x[..., D/2:], x[..., :D/2]], -1) * sin

with cos and sin in x's dtype broadcasting to x. The node keeps cos and sin as
operands (they are shared by every layer's q and k, so they are not absorbed) and
computes the same products and sums, bit for bit. When rope_tables.py can prove
that the tables are cos/sin((offset[b] + l) * inv_freq) of a constant inv_freq,
the node also carries offset and freqs so that devices with a fused rope kernel
skip the tables.
"""

from __future__ import annotations

from typing import Optional

import torch

from backends.mlx.exporter.dtypes import FLOAT_DTYPES
from backends.mlx.exporter.fusion.graph_match import (Constants, aten, binary_operands, dtype, is_op, last_axis, only_user,
                                             same_shape, shape)
from backends.mlx.exporter.fusion.pattern import Fusion
from backends.mlx.exporter.fusion.rope_tables import RopeTables, prove_tables

_INT64_MAX = 2**63 - 1


def _slice_args(node) -> Optional[tuple]:
    """(x, dim, start, end) of a unit-step slice."""
    if not is_op(node, aten.slice_copy.Tensor):
        return None
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    if step != 1 or not isinstance(x, torch.fx.Node):
        return None
    return x, dim, 0 if start is None else start, _INT64_MAX if end is None else end


def _rotate_half_source(r) -> Optional[tuple]:
    """(x, interior nodes) when r = cat([-x[..., D/2:], x[..., :D/2]], -1) for a static even D."""
    if not is_op(r, aten.cat.default) or len(r.args[0]) != 2:
        return None
    dim = r.args[1] if len(r.args) > 1 else 0
    neg, low = r.args[0]
    if not last_axis(dim, len(shape(r) or ())) or not is_op(neg, aten.neg.default):
        return None
    high, low_args = _slice_args(neg.args[0]), _slice_args(low)
    if high is None or low_args is None:
        return None
    x = high[0]
    xs = shape(x)
    if low_args[0] is not x or not xs or not isinstance(xs[-1], int) or xs[-1] % 2:
        return None
    d = xs[-1]
    if not (last_axis(high[1], len(xs)) and last_axis(low_args[1], len(xs))):
        return None
    if high[2] != d // 2 or high[3] < d or low_args[2] != 0 or low_args[3] != d // 2:
        return None
    if only_user(neg) is not r or only_user(neg.args[0]) is not neg or only_user(low) is not r:
        return None
    return x, {neg, neg.args[0], low}


def _table_fits(t, x) -> bool:
    """t broadcasts to x without changing x's shape, has x's last size and dtype."""
    ts, xs = shape(t), shape(x)
    if not ts or len(ts) > len(xs) or dtype(t) != dtype(x) or not same_shape(ts[-1:], xs[-1:]):
        return False
    lead = len(xs) - len(ts)
    return all(same_shape([a], [1]) or same_shape([a], [xs[lead + i]]) for i, a in enumerate(ts))


def _other(ops, node):
    return ops[1] if ops[0] is node else ops[0] if ops[1] is node else None


def match_rope(root, consts: Constants) -> Optional[Fusion]:
    ops = binary_operands(root, aten.add.Tensor)
    if ops is None:
        return None
    for mul_x, mul_r in (ops, ops[::-1]):
        rot_ops = binary_operands(mul_r, aten.mul.Tensor)
        if rot_ops is None:
            continue
        for r in rot_ops:
            found = _rotate_half_source(r) if only_user(r) is mul_r else None
            if found is None:
                continue
            x, interior = found
            sin = _other(rot_ops, r)
            x_ops = binary_operands(mul_x, aten.mul.Tensor)
            cos = _other(x_ops, x) if x_ops is not None else None
            if not isinstance(cos, torch.fx.Node) or not isinstance(sin, torch.fx.Node):
                continue
            if only_user(mul_x) is not root or only_user(mul_r) is not root or cos is x or sin is x:
                continue
            if dtype(x) not in FLOAT_DTYPES or dtype(root) != dtype(x) or not same_shape(shape(root), shape(x)):
                continue
            if not (_table_fits(cos, x) and _table_fits(sin, x)):
                continue
            interior |= {r, mul_x, mul_r}
            return Fusion("RopeNode", root, frozenset(interior), _emitter(x, cos, sin, prove_tables(x, cos, sin, consts)))
    return None


def _emitter(x, cos, sin, tables: Optional[RopeTables]):
    def emit(b):
        fields = dict(x=b.tid(x), cos=b.tid(cos), sin=b.tid(sin))
        if tables is not None:
            fields["offset"] = tables.emit_offset(b)
            fields["freqs"] = b.add_constant(tables.freqs)
        return b.op("RopeNode", **fields)

    return emit
