"""Pipelined decoding: the program keeps each call's sampled token on the device and returns it one
call later, so a decode loop never waits for the step it has just started.

    call k:  tokens [B, 1] = -1  ->  the device feeds row b the token it sampled at call k-1
             returns the outputs of call k-1 (token, and logprobs when exported)

The runtime waits only for a call's outputs (backends/mlx/runtime/backend.cpp), and these depend
only on the previous call, which has finished or nearly: the device computes step k while the host
handles token k-1 and builds call k+1, as mlx-lm overlaps its steps. A call's own result comes back
from the next call; the first call's outputs (from before any step) are meaningless.

A token input < 0 anywhere in a row means that row's last sampled token. A loop must know the token
before it builds the next call when it constrains the next step with it (structured output), so
programs with the allowed-mask input are exported unpipelined by default.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import SamplingHead


class FedBackSteps(nn.Module):
    """Wraps a SamplingHead over a StaticCacheLM: same inputs, outputs delayed by one call."""

    def __init__(self, head: nn.Module, config: SamplerConfig, batch: int):
        super().__init__()
        if config.expose_counts:
            raise ValueError("expose_counts is for sampler tests, not pipelined programs")
        self.head = head
        # The last call's outputs, in output order; the first one (the token) is also what a -1 feeds.
        shapes = [("token", (batch,), torch.int64)]
        if config.logprobs:
            n = config.logprobs
            shapes += [("logprob", (batch,), torch.float32), ("top_ids", (batch, n), torch.int64),
                       ("top_logprobs", (batch, n), torch.float32)]
        self.names = [f"last_{name}" for name, _, _ in shapes]
        for name, (_, shape, dtype) in zip(self.names, shapes):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def forward(self, *args, **knobs):  # args: tokens, start_pos, lengths; knobs: the head's keywords
        tokens, *model_args = args
        last = [getattr(self, name) for name in self.names]
        tokens = torch.where(tokens < 0, last[0].unsqueeze(1), tokens)
        out = self.head(tokens, *model_args, **knobs)
        out = out if isinstance(out, tuple) else (out,)
        previous = tuple(buffer.clone() for buffer in last)
        for buffer, value in zip(last, out):
            buffer.copy_(value)
        return previous if len(previous) > 1 else previous[0]

    # torch.export names the inputs (and matches dynamic shapes to them) by forward's signature:
    # the head's, knob keywords included, so both programs export from the same description.
    forward.__signature__ = inspect.signature(SamplingHead.forward)
