"""Llama-style blocks: Llama, Mistral, Qwen2, Qwen3 (RMSNorm, rotary embedding, grouped-query attention,
gated MLP; Qwen3's per-head q/k norms)."""

from __future__ import annotations

import torch
from torch import nn

from backends.mlx.llm.decoder.families.adapter import merge_heads, require, rotate_half, split_heads


class LlamaFamily:
    """RMSNorm, rotary position embedding, grouped-query attention, gated MLP."""

    def __init__(self, model: nn.Module):
        base = getattr(model, "model", None)
        require(model, ["model", "lm_head"], "the model")
        require(base, ["embed_tokens", "layers", "norm", "rotary_emb"], "model.model")
        for i, layer in enumerate(base.layers):
            require(layer, ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"], f"layer {i}")
            require(layer.self_attn, ["q_proj", "k_proj", "v_proj", "o_proj"], f"layer {i} self_attn")
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer types {sorted(set(layer_types))}: only full attention is supported "
                             "(sliding-window layers are not)")
        self.model, self.base = model, base
        self.num_layers = len(base.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = getattr(base.layers[0].self_attn, "scaling", self.head_dim ** -0.5)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        x = self.base.embed_tokens(tokens)
        cos, sin = self.base.rotary_emb(x, positions)
        return x, (cos.unsqueeze(1), sin.unsqueeze(1))

    def attention_in(self, i: int, x: torch.Tensor, rope):
        layer = self.base.layers[i]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = split_heads(attn.q_proj(h), self.heads, self.head_dim)
        k = split_heads(attn.k_proj(h), self.kv_heads, self.head_dim)
        v = split_heads(attn.v_proj(h), self.kv_heads, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head's dims
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer = self.base.layers[i]
        x = x + layer.self_attn.o_proj(merge_heads(attended))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(x))
