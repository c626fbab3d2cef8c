"""mlx::gather_mm -> GatherMmNode; mlx::gather_qmm -> GatherQmmNode (MoE expert matmuls).

The expert stacks are graph constants; the runtime indexes them with mlx::core::gather_mm / gather_qmm.
Operand dtypes were checked when the op was traced (custom_kernel_ops/experts.py).
"""

from __future__ import annotations

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::gather_*)
from backends.mlx.exporter.builder.registry import REGISTRY


@REGISTRY.register(torch.ops.mlx.gather_mm.default)
def _gather_mm(b, node):
    x, w, indices, transposed = node.args[:4]
    return b.op("GatherMmNode", x=b.tid(x), w=b.tid(w), indices=b.tid(indices), transposed=bool(transposed))


@REGISTRY.register(torch.ops.mlx.gather_qmm.default)
def _gather_qmm(b, node):
    x, w, scales, biases, indices, group_size, bits = node.args[:7]
    return b.op("GatherQmmNode", x=b.tid(x), w=b.tid(w), scales=b.tid(scales), biases=b.tid(biases),
                indices=b.tid(indices), group_size=int(group_size), bits=int(bits))
