"""softmax and log_softmax; half precision computes in float32 like PyTorch."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, float_only, half_type, ndim, norm_axis, out_dtype


def _softmax(log: bool):
    def handler(b, node):
        src, dim = node.args[:2]
        dtype = out_dtype(node)
        compute = torch.float32 if half_type(dtype) else dtype
        x = b.operand(src, compute)
        out = b.op("SoftmaxNode", x=x, axis=norm_axis(dim, max(ndim(src), 1)), log=log)
        return b.cast(out, compute, dtype)

    return handler


REGISTRY.register(aten._softmax.default, aten.softmax.int, supports=float_only)(_softmax(False))
REGISTRY.register(aten._log_softmax.default, aten.log_softmax.int, supports=float_only)(_softmax(True))
