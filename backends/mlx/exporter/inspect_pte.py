"""Find etmlx delegate blobs inside a .pte and describe their graphs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from executorch.exir._serialize._program import deserialize_pte_binary

from backends.mlx.exporter.preprocess import BACKEND_ID
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize

TAG_NAMES = {v: k for k, v in NODE_TAGS.items()}


def delegate_blobs(pte: bytes) -> list[bytes]:
    """Every etmlx delegate payload in the program, in plan order."""
    program = deserialize_pte_binary(pte).program
    blobs = []
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id == BACKEND_ID:
                blobs.append(bytes(program.backend_delegate_data[delegate.processed.index].data))
    return blobs


def instruction_kinds(graph) -> Counter:
    """How many instructions of each node kind a deserialized delegate graph holds."""
    return Counter(TAG_NAMES.get(ins.nodeType, f"tag{ins.nodeType}") for ins in graph.instructions or [])


def describe(path: Path) -> str:
    pte = Path(path).read_bytes()
    blobs = delegate_blobs(pte)
    lines = [f"{path}: {len(pte)} bytes, {len(blobs)} etmlx delegate blob(s)"]
    for i, blob in enumerate(blobs):
        g = deserialize(blob)
        kinds = instruction_kinds(g)
        lines.append(f"  blob {i}: {len(blob)} bytes, {g.numTensors} tensor slots, {g.numValues} value slots, "
                     f"{len(g.constants or [])} constants ({sum(1 for c in g.constants or [] if c.key)} in named data), "
                     f"{len(g.inputs or [])} inputs, "
                     f"{len(g.outputs or [])} outputs, {len(g.instructions or [])} instructions")
        for kind, n in kinds.most_common():
            lines.append(f"    {n:4d} x {kind}")
        if g.plainStep is not None and len(g.plainStep):  # exporter/plain_step.py
            plain = deserialize(bytes(g.plainStep))
            when = (g.inputs or [])[g.plainStepWhen].name if 0 <= g.plainStepWhen < len(g.inputs or []) else None
            lines.append(f"    plain step: {len(g.plainStep)} bytes, {len(plain.instructions or [])} instructions, "
                         f"run when input {g.plainStepWhen} ({(when or b'?').decode()}) has size 1 along axis 1")
    return "\n".join(lines)


def host_constant_bytes(pte: bytes) -> int:
    """Bytes of tensor data ExecuTorch itself holds (its constant buffer and constant segment), outside every
    delegate and the named data: a model whose weights all live in the delegate's named data holds none."""
    program = deserialize_pte_binary(pte).program
    inline = sum(len(buffer.storage) for buffer in program.constant_buffer)
    offsets = list(program.constant_segment.offsets or [])
    segment = program.segments[program.constant_segment.segment_index].size if offsets else 0
    return inline + segment
