"""ExecuTorch BackendDetails: turns a delegated edge subgraph into an etmlx blob."""

from __future__ import annotations

from typing import List, final

from executorch.exir.backend.backend_details import BackendDetails, CompileSpec, PreprocessResult
from torch.export.exported_program import ExportedProgram

import backends.mlx.exporter.ops  # noqa: F401  (registers the handlers)
from backends.mlx.exporter.builder.program_builder import ProgramBuilder
from backends.mlx.exporter.builder.weights import PLACEMENTS, WeightStore
from backends.mlx.exporter.plain_step import attach_plain_step
from backends.mlx.serialization.serializer import serialize

# The id the .pte records and the C++ runtime registers; deliberately not upstream's "MLXBackend".
BACKEND_ID = "EtmlxBackend"

# CompileSpec(FUSE_SPEC, b"0") turns the fused-node pattern matching off (for A/B measurements).
FUSE_SPEC = "etmlx.fuse"

# CompileSpec(WEIGHTS_SPEC, b"inline" | b"pte" | b"external"): where constants' bytes go (builder/weights.py);
# b"pte" (named data in the .pte's segments) when absent.
WEIGHTS_SPEC = "etmlx.weights"

# CompileSpec(ACTIVATIONS_SPEC, b"int16" | b"int8" | b"float32"): how the CPU kernel set rounds the activations of
# the program's quantized products (schema.fbs Graph.qmm_activations; b"int16" when absent). In schema order.
ACTIVATIONS_SPEC = "etmlx.qmm_activations"
QMM_ACTIVATIONS = ("int16", "int8", "float32")

# CompileSpec(RANK_SPEC, b"RANK/RANKS/GROUP_ID"): one rank's file of a tensor-parallel program (schema.fbs
# Graph.ranks, rank, group_id; llm/distributed/); a one-rank program when absent.
RANK_SPEC = "etmlx.rank"


def fusion_enabled(compile_specs: List[CompileSpec]) -> bool:
    for spec in compile_specs:
        if spec.key == FUSE_SPEC:
            if bytes(spec.value) not in (b"0", b"1"):
                raise ValueError(f"compile spec {FUSE_SPEC} must be b'0' or b'1', got {spec.value!r}")
            return bytes(spec.value) == b"1"
    return True


def weights_placement(compile_specs: List[CompileSpec]) -> str:
    for spec in compile_specs:
        if spec.key == WEIGHTS_SPEC:
            value = bytes(spec.value).decode("ascii", "replace")
            if value not in PLACEMENTS:
                raise ValueError(f"compile spec {WEIGHTS_SPEC} must be one of {', '.join(PLACEMENTS)}, got {value!r}")
            return value
    return "pte"


def qmm_activations(compile_specs: List[CompileSpec]) -> str:
    for spec in compile_specs:
        if spec.key == ACTIVATIONS_SPEC:
            value = bytes(spec.value).decode("ascii", "replace")
            if value not in QMM_ACTIVATIONS:
                raise ValueError(f"compile spec {ACTIVATIONS_SPEC} must be one of {', '.join(QMM_ACTIVATIONS)}, "
                                 f"got {value!r}")
            return value
    return "int16"


def rank_of(compile_specs: List[CompileSpec]) -> tuple[int, int, str]:
    """(rank, ranks, group id) of RANK_SPEC; (0, 1, "") for a one-rank program."""
    for spec in compile_specs:
        if spec.key == RANK_SPEC:
            rank, ranks, group_id = bytes(spec.value).decode("ascii").split("/", 2)
            if not (0 <= int(rank) < int(ranks)):
                raise ValueError(f"compile spec {RANK_SPEC}: rank {rank} of {ranks} ranks")
            return int(rank), int(ranks), group_id
    return 0, 1, ""


@final
class EtmlxBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: List[CompileSpec]) -> PreprocessResult:
        weights = WeightStore(weights_placement(compile_specs))
        graph = ProgramBuilder(edge_program, fuse=fusion_enabled(compile_specs), weights=weights).build()
        graph.qmmActivations = QMM_ACTIVATIONS.index(qmm_activations(compile_specs))
        graph.rank, graph.ranks, graph.groupId = rank_of(compile_specs)
        attach_plain_step(graph, compile_specs)
        return PreprocessResult(processed_bytes=serialize(graph), data_store_output=weights.output())


assert EtmlxBackend.__name__ == BACKEND_ID
