"""mlx::all_sum -> AllSumNode, mlx::all_gather -> AllGatherNode: a tensor-parallel program's collectives;
mlx::send -> SendNode, mlx::recv_like -> RecvNode: a pipeline-parallel program's hidden state between stages
(custom_kernel_ops/collectives.py). The runtime runs them over the rank group the program joins at load."""

from __future__ import annotations

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::all_sum, mlx::all_gather)
from backends.mlx.exporter.builder.registry import REGISTRY


@REGISTRY.register(torch.ops.mlx.all_sum.default)
def _all_sum(b, node):
    return b.op("AllSumNode", x=b.tid(node.args[0]))


@REGISTRY.register(torch.ops.mlx.all_gather.default)
def _all_gather(b, node):
    return b.op("AllGatherNode", x=b.tid(node.args[0]))


@REGISTRY.register(torch.ops.mlx.send.default)
def _send(b, node):
    return b.op("SendNode", x=b.tid(node.args[0]), dst=int(node.args[1]))


@REGISTRY.register(torch.ops.mlx.recv_like.default)
def _recv_like(b, node):
    return b.op("RecvNode", like=b.tid(node.args[0]), src=int(node.args[1]))
