"""ExecuTorch BackendDetails: turns a delegated edge subgraph into an etmlx blob."""

from __future__ import annotations

from typing import List, final

from executorch.exir.backend.backend_details import BackendDetails, CompileSpec, PreprocessResult
from torch.export.exported_program import ExportedProgram

import backends.mlx.ops  # noqa: F401  (registers the handlers)
from backends.mlx.builder.program_builder import ProgramBuilder
from backends.mlx.serialization.serializer import serialize

# The id the .pte records and the C++ runtime registers; deliberately not upstream's "MLXBackend".
BACKEND_ID = "EtmlxBackend"


@final
class EtmlxBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: List[CompileSpec]) -> PreprocessResult:
        graph = ProgramBuilder(edge_program).build()
        return PreprocessResult(processed_bytes=serialize(graph))


assert EtmlxBackend.__name__ == BACKEND_ID
