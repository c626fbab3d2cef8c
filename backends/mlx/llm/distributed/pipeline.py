"""One rank's stage of a pipeline-parallel causal LM: rank r holds a contiguous block of the decoder layers
(split_layers: as even as possible, the earlier ranks taking one more while the count does not divide), rank 0
also the embedding, the last rank also the final norm and the head. Each stage is the transformers model itself
with its layer list cut to the block (layer indices, `num_hidden_layers` and `layer_types` renumbered to match,
so the KV cache holds only the block's layers), and:

- on a rank after the first, the embedding replaced by `RecvHidden`: the hidden state received from rank r - 1
  (mlx::recv_like; the token ids only give its shape);
- on a rank before the last, the final norm replaced by `SendHidden` (the block's hidden state sent to rank r + 1
  by mlx::send) and the head by `NoLogits` (zeros, after the send);
- on every rank, the head's logits summed over the ranks (mlx::all_sum): the last rank's logits plus zeros reach
  every rank, which samples the same token from them with the same seed, as a tensor-parallel program's ranks do.
  That costs a vocabulary's logits per step (vocab x 4 B for float32) beside hidden x 4 B per hop.

Each stage's step is one chain (receive, layers, send, all_sum), so every rank meets its point-to-point step and the
all_sum in the same order: MLX's receive has no inputs, and a graph where it were independent of a collective could
run them in either order and deadlock against the other ranks.

Families: those tested with token equality against the one-rank program (tests/test_pipeline_parallel.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::send, mlx::recv_like, mlx::all_sum)
from backends.mlx.llm.distributed.shard import decoder_layers

FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_moe")


def split_layers(layers: int, ranks: int) -> list[range]:
    """Each rank's contiguous block of `layers` layers: layers // ranks each, the first layers % ranks one more."""
    size, extra = divmod(layers, ranks)
    blocks, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        blocks.append(range(start, end))
        start = end
    return blocks


def check_pipelinable(model: nn.Module, ranks: int) -> None:
    """A one-line ValueError naming what stops `model` from splitting into `ranks` stages."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"pipeline_parallel must be an int >= 2, got {ranks!r}")
    if getattr(model.config, "vision_config", None) is not None:
        raise ValueError("pipeline_parallel: vision-language models are not split yet")
    family = getattr(model.config, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"pipeline_parallel: {family or type(model).__name__} models are not split yet "
                         f"(split: {', '.join(FAMILIES)})")
    count = len(decoder_layers(model))
    if ranks > count:
        raise ValueError(f"pipeline_parallel {ranks}: the model has {count} decoder layers, fewer than the ranks")


class RecvHidden(nn.Module):
    """The embedding's place on a later stage: the previous stage's hidden state, [B, L, hidden]."""

    def __init__(self, src: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.src, self.hidden, self.dtype = src, hidden, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Only the shape and dtype of `like` are read (recv_like): no buffer is filled.
        like = input_ids.unsqueeze(-1).expand(*input_ids.shape, self.hidden).to(self.dtype)
        return torch.ops.mlx.recv_like(like, self.src)


class SendHidden(nn.Module):
    """The final norm's place on an earlier stage: sends the hidden state on and returns it (the send happens
    when what is computed from it is evaluated, which NoLogits makes the program's outputs depend on)."""

    def __init__(self, dst: int):
        super().__init__()
        self.dst = dst

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mlx.send(hidden, self.dst)


class NoLogits(nn.Module):
    """The head's place on an earlier stage: zero logits computed from the sent hidden state, summed with the
    other ranks' (the last rank's logits)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        zeros = (hidden[..., :1] * 0).expand(*hidden.shape[:-1], self.vocab)
        return torch.ops.mlx.all_sum(zeros)


class BroadcastLogits(nn.Module):
    """The last stage's head, its logits summed with the earlier ranks' zeros so that every rank gets them."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mlx.all_sum(self.head(hidden))


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The hidden state's dtype: the model's floating tensors' (a quantized model keeps its norms in it)."""
    return next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), torch.float32)


def stage_model(model: nn.Module, rank: int, ranks: int) -> nn.Module:
    """Rank `rank`'s stage of `model` (of `ranks`), a new module sharing its parameters with `model`, which is
    left as it was."""
    check_pipelinable(model, ranks)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of 0..{ranks - 1}")
    block = split_layers(len(decoder_layers(model)), ranks)[rank]
    # Every tensor is shared, not copied; the config is copied (the stage's modules read its layer count).
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    part = copy.deepcopy(model, memo)
    base = getattr(part, part.base_model_prefix)
    kept = [base.layers[i] for i in block]
    for local, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = local
    base.layers = nn.ModuleList(kept)
    config = part.config
    types = getattr(config, "layer_types", None)
    if types:
        config.layer_types = [types[i] for i in block]
    config.num_hidden_layers = len(kept)
    if rank > 0:
        base.embed_tokens = RecvHidden(rank - 1, config.hidden_size, _float_dtype(model))
    if rank < ranks - 1:
        base.norm = SendHidden(rank + 1)
        part.lm_head = NoLogits(config.vocab_size)
    else:
        part.lm_head = BroadcastLogits(part.lm_head)
    return part
