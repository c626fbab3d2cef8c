"""torch.ops.mlx.all_sum(x) and torch.ops.mlx.all_gather(x, ranks): the collectives of a tensor-parallel program
(llm/distributed/), lowered to AllSumNode / AllGatherNode, which run MLX's collectives over the rank group the
program joins at load (schema.fbs). torch.ops.mlx.send(x, dst) and torch.ops.mlx.recv_like(like, src): a
pipeline-parallel stage's hidden state to the next stage and from the previous one (SendNode / RecvNode).

Eagerly, torch has no such group here: both act as the group of one process they are traced in would if every rank
held the same x (all_sum: x; all_gather: `ranks` copies of x along axis 0); send returns x (as MLX's send does:
evaluating it sends) and recv_like zeros of like's shape and dtype. That is what the export's shape probe
needs; a rank's real values exist only in the runtime, so tensor-parallel programs are checked there against the
one-rank program (tests/test_distributed.py)."""

from __future__ import annotations

import torch


@torch.library.custom_op("mlx::all_sum", mutates_args=())
def all_sum(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@all_sum.register_fake
def _all_sum_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("mlx::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, ranks: int) -> torch.Tensor:
    return torch.cat([x] * ranks, dim=0)


@all_gather.register_fake
def _all_gather_fake(x, ranks):
    return x.new_empty((x.shape[0] * ranks, *x.shape[1:]))


@torch.library.custom_op("mlx::send", mutates_args=())
def send(x: torch.Tensor, dst: int) -> torch.Tensor:
    return x.clone()


@send.register_fake
def _send_fake(x, dst):
    return torch.empty_like(x)


@torch.library.custom_op("mlx::recv_like", mutates_args=())
def recv_like(like: torch.Tensor, src: int) -> torch.Tensor:
    return torch.zeros_like(like)


@recv_like.register_fake
def _recv_like_fake(like, src):
    return torch.empty_like(like)
