"""ScoringHead: the logprob of given continuation tokens (LMTP's SCORE, evaluations).

    head = ScoringHead(model)                 # model returns [B, S, V] logits
    logprobs = head(ids, targets=targets)     # [B, S]: log p(targets[:, s] | position s)

Position s scores targets[:, s] with the model's raw distribution at s (log_softmax of the
logits, float32). With `top=N` it also returns the N most likely ids and their logprobs per
position, as OpenAI's prompt logprobs do.
"""

from __future__ import annotations

import torch
from torch import nn


class ScoringHead(nn.Module):
    def __init__(self, model: nn.Module, top: int = 0):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(top, int) or top < 0:
            raise ValueError(f"top must be an int >= 0, got {top!r}")
        self.model = model
        self.top = top

    def forward(self, *args, targets: torch.Tensor, **kwargs):
        logits = self.model(*args, **kwargs)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"the model must return [batch, seq, vocab] logits, got {getattr(logits, 'shape', None)}")
        if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int32, torch.int64):
            raise TypeError("targets must be an integer tensor")
        if tuple(targets.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"targets must be [batch, seq] = {tuple(logits.shape[:2])}, got {tuple(targets.shape)}")
        if self.top > logits.shape[-1]:
            raise ValueError(f"top={self.top} exceeds the vocabulary ({logits.shape[-1]})")
        dist = torch.log_softmax(logits.to(torch.float32), dim=-1)
        scores = dist.gather(2, targets.to(torch.int64).unsqueeze(2)).squeeze(2)
        if not self.top:
            return scores
        top_logprobs, top_ids = torch.topk(dist, self.top, dim=-1)
        return scores, top_ids, top_logprobs
