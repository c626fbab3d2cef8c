"""Which subgraphs of a delegated program become one fused node.

A matcher looks at one fx node and either declines or returns a Fusion: the node
whose value the fused node produces (`root`), the nodes whose values nothing but
the pattern uses (`absorbed`: the builder emits nothing for them) and how to emit
the replacement. Matchers only claim a subgraph whose result they reproduce
(bit for bit on the CPU device, or within the tolerance each matcher states),
and each checks that every absorbed value has no user outside its pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.export import ExportedProgram

from backends.mlx.exporter.fusion.graph_match import Constants
from backends.mlx.exporter.fusion.rms_norm import match_rms_norm
from backends.mlx.exporter.fusion.rope import match_rope


@dataclass
class FusionPlan:
    by_root: dict = field(default_factory=dict)
    absorbed: set = field(default_factory=set)

    def kinds(self) -> list[str]:
        return [f.kind for f in self.by_root.values()]


MATCHERS = (match_rms_norm, match_rope)


def plan_fusions(ep: ExportedProgram) -> FusionPlan:
    consts = Constants(ep)
    plan = FusionPlan()
    claimed: set = set()
    for node in ep.graph.nodes:
        if node.op != "call_function" or node in claimed:
            continue
        for match in MATCHERS:
            fusion = match(node, consts)
            if fusion is None:
                continue
            nodes = fusion.absorbed | {fusion.root}
            if nodes & claimed:
                continue
            claimed |= nodes
            plan.by_root[fusion.root] = fusion
            plan.absorbed |= fusion.absorbed
            break
    return plan
