"""The eager reference of a --kv-bits program: the model's forward over a quantized KV cache.

The export check (verify.py) compares a program with `model(ids).logits`, one causal forward over the prompt and
the tokens so far. A program whose cache is quantized attends over the keys and values as its cache holds them,
so its reference does too: `KvCacheReference(model, bits, group_size)(ids)` runs StaticCacheLM with that cache
over the whole sequence at once. Each position's keys are quantized on their own (kv_quant.py), so a one-shot
forward holds the same cache entries as the program's prefill and decode steps wrote, and gives each step's
logits.

The export check pins the program's own cache entries (`pin_program_cache`): it then compares the program's
computation over the cache it holds with the eager model's over the same entries, and separately bounds how far
those entries lie from the eager keys and values (within a step and a bit: a quantizer that packs or scales
wrongly is many steps off).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from backends.mlx.llm.decoder.kv_cache import StaticCacheLM


class KvCacheReference(nn.Module):
    """Callable as a transformers causal LM for the export checks (`.logits` of a [1, T] forward); its modules
    and parameters are the model's (the checks read dtype and quantization from them)."""

    def __init__(self, model: nn.Module, bits: int, group_size: int, scale_dtype: str = ""):
        super().__init__()
        self.model = model
        self.bits, self.group_size, self.scale_dtype = bits, group_size, scale_dtype
        self.pinned = None  # per layer, the program's six cache entries [1, Hkv, T, .] (pin_program_cache)
        self.pin_steps = 0.0

    def pin_program_cache(self, state, positions: int) -> bool:
        """Take the program's own cache entries for positions [0, positions) of row 0 (its ProgramState) as this
        reference's cache, in place of its own quantization of the same keys and values: a value near a step's
        edge rounds either way on an ulp's difference upstream, and a flipped 4-bit key moves an 8B random model's
        logits by ~0.4, beyond the check's tolerance. The forward then also measures how far the program's entries
        lie from its own float keys and values (`pin_steps`, in quantization steps), which the check bounds. False
        (nothing pinned) where the buffers are not six per layer with every position kept (a ring narrower than
        the positions)."""
        buffers = state.buffers
        packed = [k for k, b in enumerate(buffers) if b.dtype == torch.uint8]
        if not buffers or len(buffers) % 6 or packed != list(range(0, len(buffers), 3)):
            return False
        if any(b.shape[2] < positions for b in buffers):
            return False
        entries = [t.unsqueeze(0) for t in state.read(0, positions)]
        self.pinned = [entries[i:i + 6] for i in range(0, len(entries), 6)]
        return True

    def unpin(self) -> None:
        """Back to quantizing the forward's own keys and values (the pinned entries belong to one sequence)."""
        self.pinned, self.pin_steps = None, 0.0

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor):
        length = input_ids.shape[1]
        lm = StaticCacheLM(self.model, max_seq_len=length, batch=input_ids.shape[0], rings=False,
                           kv_bits=self.bits, kv_group_size=self.group_size,
                           kv_scale_dtype=self.scale_dtype)
        if self.pinned is not None:
            if len(self.pinned) != len(lm.layers) or self.pinned[0][0].shape[2] < length:
                raise ValueError(f"the pinned cache holds {len(self.pinned)} layers of "
                                 f"{self.pinned[0][0].shape[2]} positions; the model has {len(lm.layers)} layers "
                                 f"and the forward {length} positions")
            lm.pinned_entries = self.pinned
        start = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        with torch.no_grad():
            logits = lm(input_ids, start)
        self.pin_steps = lm.pin_steps
        return SimpleNamespace(logits=logits)
