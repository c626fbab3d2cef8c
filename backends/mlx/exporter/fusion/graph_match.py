"""Small questions a pattern matcher asks about an edge-dialect fx graph.

Every helper answers None / False when the graph does not have the asked shape,
so a matcher can give up at the first mismatch without raising.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.export import ExportedProgram

from backends.mlx.exporter.edge_target import aten_target

aten = torch.ops.aten
_dim_order_ops = getattr(torch.ops, "dim_order_ops", None)

# Dtype conversions (and plain copies) as they appear after edge lowering.
CASTS = {aten._to_copy.default, aten.clone.default, aten.alias_copy.default}
if _dim_order_ops is not None and hasattr(_dim_order_ops, "_to_dim_order_copy"):
    CASTS |= {_dim_order_ops._to_dim_order_copy.default, _dim_order_ops._clone_dim_order.default}


def target(node) -> object:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    return aten_target(node.target)


def is_op(node, *targets) -> bool:
    return target(node) in targets


def val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def dtype(node) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape(node) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def same_size(a, b) -> bool:
    """Two sizes (ints or SymInts) that are equal for every input."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def same_shape(a: Iterable, b: Iterable) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def only_user(node) -> Optional[torch.fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def users_within(node, allowed: set) -> bool:
    """Every use of `node` is by a node in `allowed` (graph outputs count as uses)."""
    return all(u in allowed for u in node.users)


def last_axis(dim, rank: int) -> bool:
    return isinstance(dim, int) and rank > 0 and (dim == rank - 1 or dim == -1)


def cast_source(node) -> Optional[torch.fx.Node]:
    """The converted tensor when `node` is a contiguous dtype conversion or copy."""
    if not is_op(node, *CASTS) or not isinstance(node.args[0], torch.fx.Node):
        return None
    order = node.kwargs.get("dim_order")
    if order is not None and list(order) != sorted(order):
        return None
    if node.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        return None
    return node.args[0]


def binary_operands(node, *targets) -> Optional[tuple]:
    """(a, b) of a two-operand op among `targets` whose alpha (if any) is 1."""
    if not is_op(node, *targets) or len(node.args) < 2:
        return None
    if node.kwargs.get("alpha", 1) != 1 or (len(node.args) > 2 and node.args[2] != 1):
        return None
    return node.args[0], node.args[1]


class Constants:
    """Values of the program's parameters, buffers and lifted constants, by placeholder."""

    def __init__(self, ep: ExportedProgram):
        sig = ep.graph_signature
        self._ep = ep
        self._mutated = set(sig.buffers_to_mutate.values())
        self._names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}

    def tensor(self, node) -> Optional[torch.Tensor]:
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
            return None
        name = self._names.get(node.name)
        if name is None or name in self._mutated:
            return None
        if name in self._ep.state_dict:
            return self._ep.state_dict[name]
        return self._ep.constants.get(name)

    def scalar(self, arg) -> Optional[float]:
        """A Python number, or the value of a 0-d constant tensor."""
        if isinstance(arg, bool):
            return None
        if isinstance(arg, (int, float)):
            return arg
        t = self.tensor(arg)
        if t is None or t.dim() != 0 or t.dtype == torch.bool:
            return None
        return t.item()
