"""A static KV cache for Llama-family (Llama, Qwen2) transformers models, owned by the program.

transformers' own exportable static-cache module does not survive ExecuTorch's decomposition on the
pinned torch, so this module re-runs the model's forward from its submodules (same weights, same
math) with per-layer key/value buffers written in place at `input_pos`:

    lm = StaticCacheLM(hf_model, max_seq_len=128)
    logits = lm(token_ids [B, L], input_pos [L])     # -> [B, L, V]

Each call writes its L new keys/values at positions `input_pos` and attends to every cached
position <= its own. The caches are mutable buffers, so an exported program keeps them on the device
between calls. Only decoder-only Llama-style blocks (RMSNorm, rotary, grouped-query attention,
gated SiLU MLP) are supported; anything else is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class StaticCacheLM(nn.Module):
    def __init__(self, model: nn.Module, max_seq_len: int, batch: int = 1):
        super().__init__()
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or not hasattr(model, "lm_head"):
            raise ValueError(f"{type(model).__name__} is not a Llama-style causal LM (needs .model.layers and .lm_head)")
        for i, layer in enumerate(layers):
            for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                if not hasattr(layer, name):
                    raise ValueError(f"layer {i} ({type(layer).__name__}) has no {name}: unsupported architecture")
            for name in ("gate_proj", "up_proj", "down_proj"):
                if not hasattr(layer.mlp, name):
                    raise ValueError(f"layer {i} MLP ({type(layer.mlp).__name__}) has no {name}: unsupported")
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        cfg = model.config
        self.model = model
        self.max_seq_len = max_seq_len
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        dtype = next(model.parameters()).dtype
        for i in range(len(layers)):
            shape = (batch, self.kv_heads, max_seq_len, self.head_dim)
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype))

    @staticmethod
    def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        base = self.model.model
        batch, length = tokens.shape
        x = base.embed_tokens(tokens)
        positions = input_pos.unsqueeze(0).expand(batch, -1)
        cos, sin = base.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # Query l may see cache slot t iff t <= input_pos[l].
        slots = torch.arange(self.max_seq_len).unsqueeze(0)
        mask = (slots <= input_pos.unsqueeze(1)).unsqueeze(0).unsqueeze(0)
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = self._rms_norm(layer.input_layernorm, x)
            q = attn.q_proj(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache = getattr(self, f"k_cache_{i}")
            v_cache = getattr(self, f"v_cache_{i}")
            k_cache.index_copy_(2, input_pos, k)
            v_cache.index_copy_(2, input_pos, v)
            out = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                                   enable_gqa=self.kv_heads != self.heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))
            h = self._rms_norm(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            x = x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.model.lm_head(self._rms_norm(base.norm, x))
