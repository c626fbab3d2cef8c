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
from executorch.exir.backend.utils import tag_constant_data
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


def tag_owned_state(ep: ExportedProgram) -> List[str]:
    """Tag each mutable buffer that one partition alone reads and updates with that partition, so
    the delegate keeps it on the device between calls (KV caches, penalty counts); return the
    buffers left to ExecuTorch.

    ExecuTorch's tag_mutated_buffer tags a buffer with one of its readers' partitions even when
    several read it; lowering then gives every reading delegate its own copy, and only the copy of
    the delegate that computes the update ever changes: the others read the buffer's first value
    forever (a pipelined program fed back a stale token once an op outside the delegate split it in
    two). A buffer used by several partitions, read by a CPU op, or updated outside its reader's
    partition stays untagged instead: ExecuTorch holds it, hands it to the delegates as an input and
    writes the updated value back after each call, which is correct, at the cost of a copy per call."""
    sig = ep.graph_signature
    mutated = {}  # buffer target -> the node computing its new value
    outputs = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    for node in outputs:
        target = sig.buffers_to_mutate.get(getattr(node, "name", None))
        if target is not None:
            mutated[target] = node
    shared = []
    for node in ep.graph.nodes:
        target = sig.inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        if target not in mutated:
            continue
        # The updated value counts as a use: it is written back where the buffer lives.
        users = list(node.users) + [mutated[target]]
        user_tags = {user.meta.get("delegation_tag") for user in users if user.op != "output"}
        if len(user_tags) == 1 and None not in user_tags:
            node.meta["delegation_tag"] = user_tags.pop()
        else:
            shared.append(target)
    return shared


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return unsupported_reason(node) is None


class MLXPartitioner(Partitioner):
    def __init__(self, compile_specs=None):
        super().__init__()
        self.delegation_spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))
        self.outside: Counter = Counter()
        self.reasons: Dict[str, str] = {}
        # Mutable buffers left to ExecuTorch because more than one delegate call (or a CPU op) uses them.
        self.shared_state: List[str] = []

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
            self.shared_state = tag_owned_state(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)

    def report(self) -> str:
        if not self.outside:
            return "every op is inside the etmlx delegate"
        lines = [f"{sum(self.outside.values())} op(s) stayed outside the etmlx delegate:"]
        for name, count in self.outside.most_common():
            lines.append(f"  {count} x {name}: {self.reasons[name]}")
        return "\n".join(lines)
