"""SamplingHead: wrap a logits-returning model so its exported program returns token ids.

    head = SamplingHead(model)
    tokens = head(*model_args, temperature=torch.tensor(0.8), seed=torch.tensor(42))

`temperature` is a graph input (change it per call, no re-export); `temperature <= 0`
is exact greedy decoding. Passing a `seed` tensor at export makes a seeded,
reproducible program; exporting with `seed=None` makes an unseeded one that draws
from MLX's global key sequence. In a decode loop pass `seed = base_seed + step`
(see `SeedSchedule`): reusing one seed every step reuses the same noise.
"""

from __future__ import annotations

import torch
from torch import nn

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::sample)
from backends.mlx.custom_kernel_ops.sample import check_sample_args
from backends.mlx.llm.sampler.processing import check_knobs, process_and_sample
from backends.mlx.llm.sampler.config import SamplerConfig


def last_position(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] as is; [B, S, V] -> the last position's [B, V]."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the wrapped model must return a logits tensor, got {type(logits).__name__}")
    if logits.dim() == 3:
        return logits[:, -1, :]
    if logits.dim() == 2:
        return logits
    raise ValueError(f"logits must be [batch, vocab] or [batch, seq, vocab], got shape {tuple(logits.shape)}")


class SamplingHead(nn.Module):
    """Returns token ids [B]; with `config.logprobs = N` also (chosen logprob [B],
    top-N ids [B, N], top-N logprobs [B, N]). Knobs enabled in `config` are keyword
    inputs named as in `SamplerConfig.knob_names()`, each a scalar or one value per row."""

    def __init__(self, model: nn.Module, config: SamplerConfig | None = None, *, batch: int | None = None,
                 vocab: int | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config or SamplerConfig()
        if self.config.penalties:
            if not (isinstance(batch, int) and batch > 0 and isinstance(vocab, int) and vocab > 0):
                raise ValueError("penalties keep [batch, vocab] counts: pass batch= and vocab= (positive ints)")
            if self.config.penalty_window:
                self.register_buffer("penalty_window", torch.full((batch, self.config.penalty_window), -1,
                                                                  dtype=torch.int64))
                self.penalty_counts = None
            else:
                self.register_buffer("penalty_counts", torch.zeros(batch, vocab, dtype=torch.int32))
                self.penalty_window = None
            self.vocab = vocab
        else:
            self.penalty_counts = None
            self.penalty_window = None

    def forward(self, *args, temperature: torch.Tensor, seed: torch.Tensor | None = None, top_k=None,
                top_p=None, min_p=None, bias_ids=None, bias_values=None, presence_penalty=None,
                frequency_penalty=None, repetition_penalty=None, penalty_reset=None, penalty_add=None, allowed_mask=None, **kwargs):
        logits = last_position(self.model(*args, **kwargs))
        check_sample_args(logits, temperature, seed)
        knobs = dict(top_k=top_k, top_p=top_p, min_p=min_p, bias_ids=bias_ids, bias_values=bias_values,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, penalty_reset=penalty_reset, penalty_add=penalty_add,
                     allowed_mask=allowed_mask)
        check_knobs(self.config, logits, knobs)
        state = self.penalty_counts if self.penalty_counts is not None else self.penalty_window
        if state is not None and (state.shape[0] != logits.shape[0] or self.vocab != logits.shape[1]):
            raise ValueError(f"penalty state is for batch {state.shape[0]} and vocab {self.vocab} but logits are "
                             f"{tuple(logits.shape)}")
        if self.config.plain:
            return torch.ops.mlx.sample(logits, temperature, seed)
        return process_and_sample(self.config, logits, temperature, seed, knobs, state)


class GreedyHead(nn.Module):
    """argmax of the last position's logits: no random op, no runtime knobs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return torch.argmax(last_position(self.model(*args, **kwargs)), dim=-1)


class SeedSchedule:
    """Seeds for a decode loop: step k uses base_seed + k, so every step draws fresh noise
    while the whole generation stays reproducible from base_seed."""

    def __init__(self, base_seed: int):
        if not isinstance(base_seed, int) or isinstance(base_seed, bool):
            raise TypeError(f"base_seed must be an int, got {type(base_seed).__name__}")
        self.base_seed = base_seed

    def __call__(self, step: int) -> torch.Tensor:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return torch.tensor(self.base_seed + step, dtype=torch.int64)
