"""One registry of op handlers keyed by aten op, each with its support predicate.

A handler emits schema nodes for one fx node and returns the tensor slot(s) it
produced. Its predicate decides, before anything is built, whether the
partitioner may claim the node: it returns None when supported or a reason.
A handler that raises during a build is a bug and is reported, never turned
into a CPU fallback.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from backends.mlx.exporter.dtypes import SUPPORTED_DTYPES
from backends.mlx.exporter.edge_target import aten_target

Predicate = Callable[[torch.fx.Node], Optional[str]]


@dataclass(frozen=True)
class OpEntry:
    target: object
    handler: Callable
    supports: Predicate


def tensor_metas(node: torch.fx.Node):
    """Fake tensors of the node's output and of every fx-node argument."""
    metas = []
    for n in [node, *node.all_input_nodes]:
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        metas.extend(v for v in vals if isinstance(v, torch.Tensor))
    return metas


def dtypes_supported(node: torch.fx.Node) -> Optional[str]:
    if "val" not in node.meta:
        return "node has no fake-tensor metadata"
    for meta in tensor_metas(node):
        if meta.dtype not in SUPPORTED_DTYPES:
            return f"dtype {meta.dtype} is not supported"
    return None


def all_of(*predicates: Predicate) -> Predicate:
    def check(node):
        for p in predicates:
            reason = p(node)
            if reason is not None:
                return reason
        return None

    return check


class Registry:
    def __init__(self):
        self._entries: dict[object, OpEntry] = {}

    def register(self, *targets, supports: Predicate | None = None):
        predicate = dtypes_supported if supports is None else all_of(dtypes_supported, supports)

        def decorate(handler):
            for t in targets:
                if t in self._entries:
                    raise ValueError(f"two handlers registered for {t}")
                self._entries[t] = OpEntry(t, handler, predicate)
            return handler

        return decorate

    def lookup(self, target) -> OpEntry | None:
        return self._entries.get(aten_target(target))

    def unsupported_reason(self, node: torch.fx.Node) -> Optional[str]:
        entry = self.lookup(node.target)
        if entry is None:
            return f"no etmlx handler for {aten_target(node.target)}"
        return entry.supports(node)

    def targets(self):
        return list(self._entries)

    @contextmanager
    def recording(self, sink: set):
        """While active, the target of every handler that runs is added to `sink` (which ops a
        program really lowered through which handler; tests use it to prove op coverage)."""
        saved = self._entries

        def traced(entry):
            def handler(b, node):
                sink.add(entry.target)
                return entry.handler(b, node)

            return OpEntry(entry.target, handler, entry.supports)

        self._entries = {t: traced(e) for t, e in saved.items()}
        try:
            yield sink
        finally:
            self._entries = saved


REGISTRY = Registry()
