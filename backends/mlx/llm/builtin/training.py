"""A short, seeded next-token training run on the CPU for the built-in model.

Documents become one token stream (BOS, document, EOS, BOS, ...) and each step takes random windows
of it, so the model also learns that a story or a chat turn ends with EOS and what follows BOS.
Every random choice comes from generators seeded by the plan, so on the same machine with the same
library versions (and thread count; builtin_model trains on one thread) a run gives the same weights.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TrainingPlan:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    seed: int
    weight_decay: float = 0.01
    final_lr_fraction: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to final_lr_fraction of lr."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.warmup) / span)))
        return self.lr * (self.final_lr_fraction + (1 - self.final_lr_fraction) * cosine)


def token_stream(encoded_documents: list[list[int]], bos: int, eos: int) -> torch.Tensor:
    """BOS + document + EOS for each document, end to end (a document that already ends in EOS keeps one)."""
    stream: list[int] = []
    for ids in encoded_documents:
        stream.append(bos)
        stream.extend(ids)
        if not ids or ids[-1] != eos:
            stream.append(eos)
    return torch.tensor(stream, dtype=torch.int64)


def _stderr(step: int, steps: int, loss: float, seconds: float) -> None:
    print(f"[builtin model] step {step:4d}/{steps} loss {loss:.3f} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def train(model: torch.nn.Module, stream: torch.Tensor, plan: TrainingPlan, log_every: int = 10,
          log: Callable[[int, int, float, float], None] = _stderr) -> list[float]:
    """Trains `model` (a Hugging Face causal LM) in place; returns the loss of every step."""
    if stream.numel() <= plan.seq_len + 1:
        raise ValueError(f"the token stream ({stream.numel()} tokens) is shorter than one window "
                         f"(seq_len {plan.seq_len} + 1)")
    batches = torch.Generator().manual_seed(plan.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95),
                                  weight_decay=plan.weight_decay)
    offsets = torch.arange(plan.seq_len + 1)
    losses = []
    start = time.perf_counter()
    model.train()
    for step in range(plan.steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.lr_at(step)
        starts = torch.randint(0, stream.numel() - plan.seq_len - 1, (plan.batch, 1), generator=batches)
        window = stream[starts + offsets]
        logits = model(input_ids=window[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.clip_norm)
        optimizer.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == plan.steps - 1:
            log(step + 1, plan.steps, losses[-1], time.perf_counter() - start)
    model.eval()
    return losses
