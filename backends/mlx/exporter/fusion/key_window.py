"""Proof that an attention mask hides every key past max(start) + L, so the runtime can drop those keys.

A static KV cache attends over all S slots and masks the unfilled ones. StaticCacheLM's mask exports as

    le(view(arange(0, S), [1, 1, 1, S]), view(P, [B, 1, L, 1]))      P [B, L] = start_pos[b] + l

(or the same `ge` with operands swapped), i.e. mask[b, 0, l, s] = s <= P[b, l]. When P's terms are
visible (see rope_tables.position_terms: a per-row integer vector, constants and an arange over the
query axis), every key at s >= max_b(start[b]) + shift + L is masked for every query, and attending
over keys [0, that) gives the same result: a prefill of 128 tokens into an empty 4096-slot cache
then costs 128 keys, not 4096, and a decode step costs the filled part of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from backends.mlx.exporter.fusion.graph_match import Constants, aten, dtype, is_op, same_size, shape
from backends.mlx.exporter.fusion.rope_tables import position_terms


@dataclass(frozen=True)
class KeyWindow:
    base: Optional[torch.fx.Node]  # integer [B] added per row (start positions), or None
    shift: int
    per_query: bool  # positions grow by one per query: the last query sees L - 1 more keys


def _unit_axes_view(node, rank: int, keep: tuple[int, ...]) -> Optional[torch.fx.Node]:
    """x when node = view(x, ...) only inserts size-1 axes, leaving x's axes at positions `keep`."""
    if not is_op(node, aten.view_copy.default, aten.reshape.default) or not isinstance(node.args[0], torch.fx.Node):
        return None
    x = node.args[0]
    out, src = shape(node), shape(x)
    if out is None or src is None or len(out) != rank or len(src) != len(keep):
        return None
    if any(not same_size(out[k], s) for k, s in zip(keep, src)):
        return None
    if any(out[i] != 1 for i in range(rank) if i not in keep):
        return None
    return x


def _slot_arange(node, slots) -> bool:
    """node is arange(0, S) with step 1 and S the key count."""
    if not is_op(node, aten.arange.start_step, aten.arange.default, aten.arange.start):
        return False
    if dtype(node) not in (torch.int32, torch.int64):
        return False
    args = list(node.args)
    start = 0 if is_op(node, aten.arange.default) else args[0]
    step = args[2] if is_op(node, aten.arange.start_step) and len(args) > 2 else 1
    return start == 0 and step == 1 and same_size(shape(node)[0], slots)


def prove_key_window(mask, q, k, consts: Constants) -> Optional[KeyWindow]:
    if not isinstance(mask, torch.fx.Node) or dtype(mask) != torch.bool or len(shape(mask) or ()) != 4:
        return None
    if is_op(mask, aten.le.Tensor):
        slots_view, pos_view = mask.args[:2]
    elif is_op(mask, aten.ge.Tensor):
        pos_view, slots_view = mask.args[:2]
    else:
        return None
    qs, ks = shape(q), shape(k)
    if qs is None or ks is None or len(qs) != 4 or len(ks) != 4:
        return None
    slots = _unit_axes_view(slots_view, 4, (3,))
    if slots is None or not _slot_arange(slots, ks[2]):
        return None
    # P is [B, L] (a row per sequence) or [L] (one shared row).
    positions = _unit_axes_view(pos_view, 4, (0, 2)) or _unit_axes_view(pos_view, 4, (2,))
    if positions is None:
        return None
    ps = shape(positions)
    if not (same_size(ps[-1], qs[2]) or same_size(ps[-1], 1)):
        return None
    terms = position_terms(positions, qs[2], qs[0], consts)
    if terms is None or not isinstance(terms.shift, int):
        return None
    return KeyWindow(terms.batch, terms.shift, terms.seq)
