"""mlx::sample, mlx::sample_fused -> one GumbelMaxNode; mlx::filter_threshold -> FilterThresholdNode;
mlx::allowed_mask -> AllowedMaskNode; mlx::drawn_or_none -> DrawnOrNoneNode.

Every sampler program draws through the one Gumbel-max definition in the runtime
(runtime/kernels/gumbel_max.h: NaN -> -inf, x / T + (-log(-log u)) with MLX's bits,
argmax; T <= 0 or NaN greedy), which custom_kernel_ops/reference/sample.py reproduces
on the host. The plain temperature program is the same node without a threshold.
"""

from __future__ import annotations

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::sample)
from backends.mlx.exporter.builder.registry import REGISTRY

F32 = torch.float32


def _opt(b, node, i, name):
    arg = node.args[i] if len(node.args) > i else node.kwargs.get(name)
    return None if arg is None else b.tid(arg)


def _with_optional(b, node, fields: dict, optional) -> dict:
    """`fields` plus each (argument index, field name) of `optional` the node was given."""
    for i, name in optional:
        tid = _opt(b, node, i, name)
        if tid is not None:
            fields[name] = tid
    return fields


def _gumbel_max(b, node, optional):
    logits, temperature = node.args[:2]
    fields = dict(x=b.operand(logits, F32), temperature=b.operand(temperature, F32))
    return b.op("GumbelMaxNode", **_with_optional(b, node, fields, optional))


@REGISTRY.register(torch.ops.mlx.sample.default)
def _sample(b, node):
    return _gumbel_max(b, node, ((2, "seed"),))


@REGISTRY.register(torch.ops.mlx.sample_fused.default)
def _sample_fused(b, node):
    return _gumbel_max(b, node, ((2, "seed"), (3, "threshold")))


@REGISTRY.register(torch.ops.mlx.filter_threshold.default)
def _filter_threshold(b, node):
    candidates = node.args[5] if len(node.args) > 5 else node.kwargs.get("candidates", 256)
    fields = dict(x=b.operand(node.args[0], F32), temperature=b.operand(node.args[1], F32),
                  candidates=int(candidates))
    return b.op("FilterThresholdNode", **_with_optional(b, node, fields, ((2, "top_k"), (3, "top_p"), (4, "min_p"))))


@REGISTRY.register(torch.ops.mlx.allowed_mask.default)
def _allowed_mask(b, node):
    x, words = node.args[:2]
    return b.op("AllowedMaskNode", x=b.operand(x, F32), mask=b.operand(words, torch.int32))


@REGISTRY.register(torch.ops.mlx.drawn_or_none.default)
def _drawn_or_none(b, node):
    tokens, x = node.args[:2]
    return b.op("DrawnOrNoneNode", tokens=b.operand(tokens, torch.int64), x=b.operand(x, F32))
