"""The eager reference of a --kv-bits program: the model's forward over a quantized KV cache.

The export check (verify.py) compares a program with `model(ids).logits`, one causal forward over the prompt and
the tokens so far. A program whose cache is quantized attends over the keys and values as its cache holds them,
so its reference does too: `KvCacheReference(model, bits, group_size)(ids)` runs StaticCacheLM with that cache
over the whole sequence at once. Each position's keys are quantized on their own (kv_quant.py), so a one-shot
forward holds the same cache entries as the program's prefill and decode steps wrote, and gives each step's
logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from backends.mlx.llm.decoder.kv_cache import StaticCacheLM


class KvCacheReference(nn.Module):
    """Callable as a transformers causal LM for the export checks (`.logits` of a [1, T] forward); its modules
    and parameters are the model's (the checks read dtype and quantization from them)."""

    def __init__(self, model: nn.Module, bits: int, group_size: int):
        super().__init__()
        self.model = model
        self.bits, self.group_size = bits, group_size

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor):
        length = input_ids.shape[1]
        lm = StaticCacheLM(self.model, max_seq_len=length, batch=input_ids.shape[0], rings=False,
                           kv_bits=self.bits, kv_group_size=self.group_size)
        start = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        with torch.no_grad():
            return SimpleNamespace(logits=lm(input_ids, start))
