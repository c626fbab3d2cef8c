"""Proof that rotary tables are cos/sin((offset[b] + l) * inv_freq), for mlx::core::fast::rope.

transformers' rotary embedding exports as

    P [Bp, L] int positions -> unsqueeze(-1) -> float32 -> * inv_freq [D/2] (a constant)
      -> cat([f, f], -1) -> cos / sin -> * attention_scaling -> to x's dtype -> unsqueeze(1)

and x is [B, H, L, D]. fast::rope computes the same tables from an integer offset per
row and `freqs` (it uses float32(1 / freqs) as inv_freq, and positions offset + l in
float32). So the tables qualify when attention_scaling is exactly 1, some float32 freqs
gives inv_freq back exactly, and P[b, l] = offset[b] + l is visible in the graph: an
arange over the sequence axis (HF's cache_position), plus constants, plus at most one
integer vector over the batch axis (a per-row start position). Positions given as an
arbitrary input vector (e.g. `input_pos [L]`) are not provably consecutive and stay
with the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from backends.mlx.exporter.fusion.graph_match import (CASTS, Constants, aten, binary_operands, cast_source, dtype, is_op,
                                             last_axis, same_size, shape)

_ARANGES = (aten.arange.start_step, aten.arange.default, aten.arange.start)


@dataclass(frozen=True)
class RopeTables:
    batch: Optional[torch.fx.Node]  # integer [Bp] added per row, or None
    shift: int
    freqs: torch.Tensor  # float32 [D/2], 1 / freqs == inv_freq exactly in float32

    def emit_offset(self, b) -> int:
        if self.batch is None:
            return b.full(self.shift, torch.int32)
        offset = b.tid(self.batch)
        if self.shift:
            offset = b.op("BinaryNode", op=_add_op(), a=offset, b=b.full(self.shift, dtype(self.batch)))
        return offset


def _add_op():
    from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp

    return BinaryOp.Add


def exact_freqs(inv_freq: torch.Tensor) -> Optional[torch.Tensor]:
    """float32 f with float32(1 / f) == inv_freq elementwise, or None when some has none."""
    inv = inv_freq.detach().cpu().to(torch.float32).numpy()
    if not np.all(np.isfinite(inv)) or np.any(inv <= 0):
        return None
    out = np.empty_like(inv)
    one = np.float32(1)
    for i, target in enumerate(inv):
        guess = np.float32(1.0 / np.float64(target))
        candidates = [guess]
        up = down = guess
        for _ in range(4):
            up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
            candidates += [up, down]
        hit = [c for c in candidates if one / c == target]
        if not hit:
            return None
        out[i] = hit[0]
    return torch.from_numpy(out)


def _strip_unsqueeze(node, dim) -> Optional[torch.fx.Node]:
    if is_op(node, aten.unsqueeze_copy.default) and node.args[1] == dim:
        return node.args[0]
    return None


def _scaled_trig(node, trig, consts) -> Optional[torch.fx.Node]:
    """E when node = trig(E) or trig(E) * 1 (transformers' attention_scaling), in float32."""
    if is_op(node, trig):
        return node.args[0]
    ops = binary_operands(node, aten.mul.Tensor, aten.mul.Scalar)
    if ops is None:
        return None
    for t, k in (ops, ops[::-1]):
        if is_op(t, trig) and consts.scalar(k) == 1 and dtype(node) == dtype(t):
            return t.args[0]
    return None


def _table_source(table, x_dtype, trig, consts) -> Optional[torch.fx.Node]:
    """The angle tensor E [Bp, L, D] behind a [Bp, 1, L, D] table."""
    t = _strip_unsqueeze(table, 1)
    if t is None:
        return None
    if dtype(t) != torch.float32:
        src = cast_source(t)
        if src is None or dtype(t) != x_dtype:
            return None
        t = src
    if dtype(t) != torch.float32:
        return None
    return _scaled_trig(t, trig, consts)


def _angles(e, consts) -> Optional[tuple]:
    """(P, inv_freq) when e = cat([f, f], -1), f = float32(P.unsqueeze(-1)) * inv_freq."""
    if not is_op(e, aten.cat.default) or len(e.args[0]) != 2 or e.args[0][0] is not e.args[0][1]:
        return None
    if not last_axis(e.args[1] if len(e.args) > 1 else 0, len(shape(e))):
        return None
    ops = binary_operands(e.args[0][0], aten.mul.Tensor)
    if ops is None:
        return None
    for pf, inv in (ops, ops[::-1]):
        inv_freq = consts.tensor(inv)
        if inv_freq is not None and inv_freq.dim() == 1 and inv_freq.dtype == torch.float32:
            break
    else:
        return None
    if dtype(pf) != torch.float32:
        return None
    # Strip casts and the one unsqueeze that gives positions their trailing axis.
    node, unsqueezed = pf, False
    while True:
        if dtype(node) not in (torch.int32, torch.int64, torch.float32):
            return None  # a narrower float on the way would round positions
        if is_op(node, *CASTS):
            node = cast_source(node)
            if node is None:
                return None
        elif not unsqueezed and is_op(node, aten.unsqueeze_copy.default) and node.args[1] in (2, -1):
            node, unsqueezed = node.args[0], True
        else:
            break
    if not unsqueezed or dtype(node) not in (torch.int32, torch.int64) or len(shape(node)) != 2:
        return None
    return node, inv_freq


@dataclass(frozen=True)
class _Terms:
    """value[b, l] = batch[b] + shift + (l if seq else 0)."""
    batch: Optional[torch.fx.Node] = None
    shift: int = 0
    seq: bool = False

    def plus(self, other: "_Terms") -> Optional["_Terms"]:
        if (self.batch is not None and other.batch is not None) or (self.seq and other.seq):
            return None
        batch = self.batch if self.batch is not None else other.batch
        return _Terms(batch, self.shift + other.shift, self.seq or other.seq)


def _int_constant(arg, consts) -> Optional[int]:
    v = consts.scalar(arg)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _identity_source(node) -> Optional[torch.fx.Node]:
    """The input of a same-dtype copy or of a slice that keeps a whole axis."""
    src = cast_source(node)
    if src is not None:
        return src if dtype(src) == dtype(node) else None
    if is_op(node, aten.slice_copy.Tensor) and isinstance(node.args[0], torch.fx.Node):
        x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
        size = shape(x)[dim]
        if step == 1 and start in (0, None) and (end is None or (isinstance(size, int) and end >= size)):
            return x
    return None


def _vector(node, length, consts) -> Optional[_Terms]:
    """A 1-d integer tensor laid along the sequence axis: only arange(start, start + L) qualifies."""
    if dtype(node) not in (torch.int32, torch.int64):
        return None
    if is_op(node, *_ARANGES):
        args = list(node.args)
        start, step = (0, 1) if is_op(node, aten.arange.default) else (args[0], args[2] if len(args) > 2 else 1)
        if step != 1 or not isinstance(start, int) or not same_size(shape(node)[0], length):
            return None
        return _Terms(shift=start, seq=True)
    ops = binary_operands(node, aten.add.Tensor, aten.add.Scalar)
    if ops is not None:
        terms = [_vector(a, length, consts) if len(shape(a) or ()) == 1 else _scalar_terms(a, consts) for a in ops]
        return None if None in terms else terms[0].plus(terms[1])
    src = _identity_source(node)
    return None if src is None else _vector(src, length, consts)


def _scalar_terms(arg, consts) -> Optional[_Terms]:
    if isinstance(arg, torch.fx.Node) and shape(arg) != ():
        return None
    v = _int_constant(arg, consts)
    return None if v is None else _Terms(shift=v)


def position_terms(node, length, batch, consts) -> Optional[_Terms]:
    """Terms of an integer tensor broadcasting to [Bp, L] positions (also the attention key window's proof)."""
    if not isinstance(node, torch.fx.Node) or len(shape(node) or ()) == 0:
        return _scalar_terms(node, consts)
    if dtype(node) not in (torch.int32, torch.int64):
        return None
    rank = len(shape(node))
    if rank == 1:
        return _vector(node, length, consts)  # broadcasts along the last (sequence) axis
    if rank != 2:
        return None
    src = _identity_source(node)
    if src is not None:
        return position_terms(src, length, batch, consts)
    if is_op(node, aten.expand_copy.default):
        return position_terms(node.args[0], length, batch, consts)
    if is_op(node, aten.unsqueeze_copy.default) and len(shape(node.args[0])) == 1:
        inner = node.args[0]
        if node.args[1] == 0:
            return _vector(inner, length, consts)
        if node.args[1] in (1, -1):  # a per-row vector along the batch axis
            n = shape(inner)[0]
            if dtype(inner) not in (torch.int32, torch.int64) or not (same_size(n, batch) or same_size(n, 1)):
                return None
            return _Terms(batch=inner)
        return None
    ops = binary_operands(node, aten.add.Tensor, aten.add.Scalar)
    if ops is not None:
        terms = [position_terms(a, length, batch, consts) for a in ops]
        return None if None in terms else terms[0].plus(terms[1])
    return None


def prove_tables(x, cos, sin, consts: Constants) -> Optional[RopeTables]:
    xs = shape(x)
    if len(xs) != 4:
        return None
    e = _table_source(cos, dtype(x), aten.cos.default, consts)
    if e is None or _table_source(sin, dtype(x), aten.sin.default, consts) is not e:
        return None
    found = _angles(e, consts)
    if found is None:
        return None
    p, inv_freq = found
    ps = shape(p)
    if not same_size(ps[1], xs[2]) or not (same_size(ps[0], xs[0]) or same_size(ps[0], 1)):
        return None
    if inv_freq.shape[0] * 2 != xs[3]:
        return None
    terms = position_terms(p, xs[2], xs[0], consts)
    if terms is None or not (terms.seq or same_size(xs[2], 1)):
        return None
    freqs = exact_freqs(inv_freq)
    if freqs is None:
        return None
    return RopeTables(terms.batch, terms.shift, freqs)
