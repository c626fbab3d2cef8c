"""MLXPartitioner: claims every node whose handler's predicate accepts it.

What it does not claim stays on ExecuTorch's CPU kernels; `report()` lists those
ops after a partition so an export can say what stayed outside the delegate.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_partitions_from_list_of_nodes,
)
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch.export.exported_program import ExportedProgram
from torch.fx.passes.operator_support import OperatorSupportBase

import backends.mlx.exporter.ops  # noqa: F401  (registers the handlers)
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.edge_target import aten_target
from backends.mlx.exporter.preprocess import BACKEND_ID

_aten = torch.ops.aten
# Ops we lower better whole than decomposed (one fused node, or fewer and exact ops than the
# decomposition: rms_norm, layer_norm, logaddexp, roll, tril/triu, ...); kept only if every node of
# the op is claimable.
_KEEP_WHOLE = (_aten.linear.default, _aten.logsumexp.default, _aten.scaled_dot_product_attention.default,
               _aten.index_copy.default, _aten.layer_norm.default, _aten.rms_norm.default, _aten.logaddexp.default,
               _aten.roll.default, _aten.tril.default, _aten.triu.default, _aten.stack.default,
               _aten.repeat_interleave.self_int, _aten.std.correction, _aten.var.dim)


def unsupported_reason(node: torch.fx.Node) -> Optional[str]:
    if node.op != "call_function":
        return "not a call"
    if node.target is operator.getitem:
        return unsupported_reason(node.args[0])
    return REGISTRY.unsupported_reason(node)


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return unsupported_reason(node) is None


class MLXPartitioner(Partitioner):
    def __init__(self, compile_specs=None):
        super().__init__()
        self.delegation_spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))
        self.outside: Counter = Counter()
        self.reasons: Dict[str, str] = {}

    def ops_to_not_decompose(self, ep: ExportedProgram) -> tuple[List, Optional[Callable]]:
        keep, declined = [], set()
        for node in ep.graph.nodes:
            if node.op == "call_function" and node.target in _KEEP_WHOLE:
                if unsupported_reason(node) is None:
                    keep.append(node.target)
                else:
                    declined.add(node.target)
        return [t for t in dict.fromkeys(keep) if t not in declined], None

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        gm = exported_program.graph_module
        self.outside.clear()
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                reason = unsupported_reason(node)
                if reason is not None:
                    name = str(aten_target(node.target))
                    self.outside[name] += 1
                    self.reasons[name] = reason
        partitions = generate_partitions_from_list_of_nodes(gm, op_support=_Support())
        tags = {}
        for partition in partitions:
            tag = f"etmlx_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        if tags:
            tag_constant_data(exported_program)
            # State mutated inside a partition (penalty counts, KV caches) is owned by the delegate.
            tag_mutated_buffer(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)

    def report(self) -> str:
        if not self.outside:
            return "every op is inside the etmlx delegate"
        lines = [f"{sum(self.outside.values())} op(s) stayed outside the etmlx delegate:"]
        for name, count in self.outside.most_common():
            lines.append(f"  {count} x {name}: {self.reasons[name]}")
        return "\n".join(lines)
