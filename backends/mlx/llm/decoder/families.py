"""Per-architecture access to a transformers causal LM's submodules, for StaticCacheLM.

An adapter splits one decoder block into the part before attention (norm, q/k/v projections,
rotary embedding) and the part after it (output projection, residual, MLP), so the cache module
can own the attention and the KV cache while every weight and norm stays the model's own.

Supported: Llama-style blocks (Llama, Mistral, Qwen2, Qwen3 with its per-head q/k norms) and
GPT-2. Anything else is refused with the missing module named.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED = "Llama, Mistral, Qwen2, Qwen3 (model.layers with self_attn q/k/v/o_proj and mlp) and GPT-2"


def _require(owner: nn.Module, names, where: str) -> None:
    for name in names:
        if getattr(owner, name, None) is None:
            raise ValueError(f"{where} ({type(owner).__name__}) has no `{name}`: unsupported architecture "
                             f"(etmlx decodes {SUPPORTED})")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B, L, H * D]. contiguous() first: the attention output's traced strides
    would otherwise let the decomposed reshape become a view that fails for dynamic L."""
    batch, heads, length, dim = x.shape
    return x.transpose(1, 2).contiguous().view(batch, length, heads * dim)


def _heads(x: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """[B, L, count * dim] -> [B, count, L, dim]"""
    batch, length = x.shape[:2]
    return x.view(batch, length, count, dim).transpose(1, 2)


class LlamaFamily:
    """RMSNorm, rotary position embedding, grouped-query attention, gated MLP."""

    def __init__(self, model: nn.Module):
        base = getattr(model, "model", None)
        _require(model, ["model", "lm_head"], "the model")
        _require(base, ["embed_tokens", "layers", "norm", "rotary_emb"], "model.model")
        for i, layer in enumerate(base.layers):
            _require(layer, ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"], f"layer {i}")
            _require(layer.self_attn, ["q_proj", "k_proj", "v_proj", "o_proj"], f"layer {i} self_attn")
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
        q = _heads(attn.q_proj(h), self.heads, self.head_dim)
        k = _heads(attn.k_proj(h), self.kv_heads, self.head_dim)
        v = _heads(attn.v_proj(h), self.kv_heads, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head's dims
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer = self.base.layers[i]
        x = x + layer.self_attn.o_proj(_merge_heads(attended))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(x))


def _as_linear(conv1d: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (x @ W + b, W stored [in, out]) as an nn.Linear holding W transposed once:
    linear is kept whole by the partitioner, and Conv1D's own forward views its input in a way
    that fails under a dynamic sequence length."""
    weight = conv1d.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=conv1d.bias is not None,
                       dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if conv1d.bias is not None:
            linear.bias.copy_(conv1d.bias.detach())
    return linear


class GPT2Family(nn.Module):
    """Learned position embeddings, LayerNorm, fused qkv projection, GELU MLP."""

    def __init__(self, model: nn.Module):
        super().__init__()
        _require(model, ["transformer", "lm_head"], "the model")
        base = model.transformer
        _require(base, ["wte", "wpe", "h", "ln_f"], "model.transformer")
        for i, block in enumerate(base.h):
            _require(block, ["ln_1", "attn", "ln_2", "mlp"], f"block {i}")
            _require(block.attn, ["c_attn", "c_proj"], f"block {i} attn")
            _require(block.mlp, ["c_fc", "c_proj", "act"], f"block {i} mlp")
        cfg = model.config
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn is not supported")
        # Held outside the module tree: StaticCacheLM registers the model itself.
        self._parts = (model, base)
        self.num_layers = len(base.h)
        self.heads = self.kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.scale = self.head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        self.qkv = nn.ModuleList(_as_linear(b.attn.c_attn) for b in base.h)
        self.attn_out = nn.ModuleList(_as_linear(b.attn.c_proj) for b in base.h)
        self.fc_in = nn.ModuleList(_as_linear(b.mlp.c_fc) for b in base.h)
        self.fc_out = nn.ModuleList(_as_linear(b.mlp.c_proj) for b in base.h)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        base = self._parts[1]
        return base.wte(tokens) + base.wpe(positions), None

    def attention_in(self, i: int, x: torch.Tensor, _rope):
        block = self._parts[1].h[i]
        q, k, v = self.qkv[i](block.ln_1(x)).split(self.heads * self.head_dim, dim=2)
        return (_heads(q, self.heads, self.head_dim), _heads(k, self.heads, self.head_dim),
                _heads(v, self.heads, self.head_dim))

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        block = self._parts[1].h[i]
        x = x + self.attn_out[i](_merge_heads(attended))
        return x + self.fc_out[i](block.mlp.act(self.fc_in[i](block.ln_2(x))))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        model, base = self._parts
        return model.lm_head(base.ln_f(x))


def family_for(model: nn.Module):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (nn.Module), got {type(model).__name__}")
    if getattr(model, "config", None) is None:
        raise ValueError(f"{type(model).__name__} has no `config`: not a transformers causal LM")
    if hasattr(model, "transformer") and hasattr(getattr(model, "transformer"), "wpe"):
        return GPT2Family(model)
    if hasattr(model, "model") and hasattr(getattr(model, "model"), "layers"):
        return LlamaFamily(model)
    raise ValueError(f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r}) has neither "
                     f"`model.layers` nor `transformer.h`: unsupported architecture (etmlx decodes {SUPPORTED})")
