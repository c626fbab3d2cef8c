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


def describe(path: Path) -> str:
    pte = Path(path).read_bytes()
    blobs = delegate_blobs(pte)
    lines = [f"{path}: {len(pte)} bytes, {len(blobs)} etmlx delegate blob(s)"]
    for i, blob in enumerate(blobs):
        g = deserialize(blob)
        kinds = Counter(TAG_NAMES.get(ins.nodeType, f"tag{ins.nodeType}") for ins in g.instructions or [])
        lines.append(f"  blob {i}: {len(blob)} bytes, {g.numTensors} tensor slots, {g.numValues} value slots, "
                     f"{len(g.constants or [])} constants ({sum(1 for c in g.constants or [] if c.key)} in named data), "
                     f"{len(g.inputs or [])} inputs, "
                     f"{len(g.outputs or [])} outputs, {len(g.instructions or [])} instructions")
        for kind, n in kinds.most_common():
            lines.append(f"    {n:4d} x {kind}")
    return "\n".join(lines)
