"""What a matcher returns: one subgraph that the builder emits as one fused node (see plan.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Fusion:
    kind: str  # the schema node it emits, e.g. "RmsNormNode"
    root: torch.fx.Node
    absorbed: frozenset
    emit: Callable  # (ProgramBuilder) -> tensor slot of root's value
