"""The op behind an fx node's target, whichever dialect the graph is in."""

from __future__ import annotations

from executorch.exir.dialects.edge._ops import EdgeOpOverload


def aten_target(target):
    """The aten (or custom) OpOverload behind an edge-dialect target."""
    if isinstance(target, EdgeOpOverload):
        return target._op
    return target
