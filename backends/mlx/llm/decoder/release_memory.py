"""Whether an export's check frees memory first: a full garbage collection, only where what it frees matters.

Before the check loads the written program, the export drops what only tracing needed (export.py), and the check
drops the program's runtime copy of the weights before the eager forward reads the model's (verify.py): at real
size, each would otherwise sit beside the next step's memory. Both need a full collection (torch.export's graphs
are cycles), which walks every object the process holds: ~0.1 s in a fresh `etmlx export`, 0.5-1 s in a process
that has built many programs (a test worker: ~10% of its time went there). Below COLLECT_FROM_BYTES of weights
what it frees is smaller than the interpreter's own footprint, so small models skip it.
"""

from __future__ import annotations

import gc
from itertools import chain

from torch import nn

from backends.mlx.runtime.allocator import give_back_freed

COLLECT_FROM_BYTES = 16 << 20


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers (meta tensors counted at their size)."""
    return sum(t.numel() * t.element_size() for t in chain(model.parameters(), model.buffers()))


def collect_if_large(model: nn.Module, give_back: bool = False) -> bool:
    """gc.collect() (then, with `give_back`, the malloc's freed pages to the OS) when the model's weights reach
    COLLECT_FROM_BYTES; whether it collected."""
    if weight_bytes(model) < COLLECT_FROM_BYTES:
        return False
    gc.collect()
    if give_back:
        give_back_freed()
    return True
