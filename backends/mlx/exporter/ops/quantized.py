"""mlx::quantized_linear -> QuantizedLinearNode; mlx::quantized_embedding -> QuantizedEmbeddingNode.

The packed weights, scales and biases are graph constants that reach the blob unchanged (the
integers mlx.core.quantize or mlx_lm wrote); the runtime runs MLX's quantized kernels on them.
"""

from __future__ import annotations

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::quantized_*)
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import out_dtype


def _params(node, first: int) -> dict:
    group_size, bits = node.args[first:first + 2]
    return dict(group_size=int(group_size), bits=int(bits))


@REGISTRY.register(torch.ops.mlx.quantized_linear.default)
def _quantized_linear(b, node):
    x, w, scales, biases, bias = node.args[:5]
    # MLX multiplies in the promoted type of x and the scales (float32 activations over bf16 scales: float32);
    # the op's result is in x's.
    compute = torch.promote_types(b.meta(x).dtype, b.meta(scales).dtype)
    fields = dict(x=b.operand(x, compute), w=b.tid(w), scales=b.tid(scales), biases=b.tid(biases),
                  **_params(node, 5))
    if bias is not None:
        fields["bias"] = b.tid(bias)
    return b.cast(b.op("QuantizedLinearNode", **fields), compute, out_dtype(node))


@REGISTRY.register(torch.ops.mlx.quantized_embedding.default)
def _quantized_embedding(b, node):
    indices, w, scales, biases = node.args[:4]
    return b.op("QuantizedEmbeddingNode", indices=b.tid(indices), w=b.tid(w), scales=b.tid(scales),
                biases=b.tid(biases), **_params(node, 4))
