"""The per-row `adapter` input of a program exported with switchable LoRA adapters (llm/lora/switchable.py):
an outer module that hands each call's indices to the adapted layers for the length of the call."""

from __future__ import annotations

import inspect

from torch import nn

from backends.mlx.llm.decoder.meta import ADAPTER_INPUT
from backends.mlx.llm.lora.switchable import AdapterChoice
from backends.mlx.llm.sampler.head import SamplingHead


class AdapterInput(nn.Module):
    """Wraps a SamplingHead (or FedBackSteps over one); takes `adapter` [B] int64 besides the head's inputs."""

    def __init__(self, program: nn.Module, choice: AdapterChoice):
        super().__init__()
        self.program = program
        self._choice = choice

    def forward(self, *args, **kwargs):
        self._choice.index = kwargs.pop(ADAPTER_INPUT)
        try:
            return self.program(*args, **kwargs)
        finally:
            self._choice.index = None


def _with_adapter(signature: inspect.Signature) -> inspect.Signature:
    """The head's signature with a keyword-only `adapter` first among its keywords: torch.export names and
    orders the program's inputs by it (tokens, start_pos, lengths, adapter, temperature, ...)."""
    params = list(signature.parameters.values())
    at = next(i for i, p in enumerate(params) if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD))
    params.insert(at, inspect.Parameter(ADAPTER_INPUT, inspect.Parameter.KEYWORD_ONLY))
    return signature.replace(parameters=params)


AdapterInput.forward.__signature__ = _with_adapter(inspect.signature(SamplingHead.forward))
