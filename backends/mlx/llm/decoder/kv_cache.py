"""A static KV cache owned by the program, for the decoder families in `families.py`.

transformers' own exportable static-cache module does not survive ExecuTorch's decomposition on the
pinned torch, so this module re-runs the model's blocks (same weights, same math) around its own
attention over per-layer key/value buffers:

    lm = StaticCacheLM(hf_model, max_seq_len=128, batch=2)
    logits = lm(tokens [B, L], start_pos [B])                 # -> [B, L, V]
    logits = lm(tokens [B, L], start_pos [B], lengths [B])    # -> [B, V] at index lengths-1 per row

Row b's tokens sit at cache positions start_pos[b] .. start_pos[b]+L-1; each query attends to the
cached positions <= its own. Rows are independent sequences at their own positions, which is what
lets a server decode rows that started at different times in one call. A row with fewer real
tokens than L (lengths[b] < L) pads: its padding writes cache slots beyond its last real token,
which its own later queries can never see before they are overwritten, because every write
starts at the row's next position. The caches are mutable buffers, so an exported program keeps
them on the device between calls.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.mlx.llm.decoder.families import family_for


class StaticCacheLM(nn.Module):
    def __init__(self, model: nn.Module, max_seq_len: int, batch: int = 1):
        super().__init__()
        self.family = family_for(model)
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if limit is not None and max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {limit} positions")
        self.model = model
        self.max_seq_len = max_seq_len
        self.batch = batch
        f = self.family
        dtype = next(model.parameters()).dtype
        for i in range(f.num_layers):
            shape = (batch, f.kv_heads, max_seq_len, f.head_dim)
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype))


    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor | None = None):
        f = self.family
        batch, length = tokens.shape
        positions = start_pos.unsqueeze(1) + torch.arange(length).unsqueeze(0)  # [B, L]
        x, rope = f.embed(tokens, positions)
        slots = torch.arange(self.max_seq_len)
        mask = (slots.view(1, 1, 1, -1) <= positions.view(batch, 1, length, 1))  # [B, 1, L, S]
        # Where each new key/value goes along the cache's position axis (a put along that axis).
        slot_index = positions.view(batch, 1, length, 1).expand(batch, f.kv_heads, length, f.head_dim)
        for i in range(f.num_layers):
            q, k, v = f.attention_in(i, x, rope)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache.scatter_(2, slot_index, k)
            v_cache.scatter_(2, slot_index, v)
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k_cache, v_cache, attn_mask=mask, scale=f.scale, enable_gqa=f.kv_heads != f.heads)
            x = f.attention_out(i, x, attended)
        if lengths is not None:
            # Only each row's sampled position meets lm_head: [B, hidden].
            last = (lengths - 1).view(batch, 1, 1).expand(batch, 1, x.shape[-1])
            x = x.gather(1, last).squeeze(1)
        return f.logits(x)
