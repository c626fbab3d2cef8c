"""GPT-2: learned position embeddings, LayerNorm, fused qkv projection (Conv1D), GELU MLP."""

from __future__ import annotations

import torch
from torch import nn

from backends.mlx.llm.decoder.families.adapter import merge_heads, require, split_heads


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
        require(model, ["transformer", "lm_head"], "the model")
        base = model.transformer
        require(base, ["wte", "wpe", "h", "ln_f"], "model.transformer")
        for i, block in enumerate(base.h):
            require(block, ["ln_1", "attn", "ln_2", "mlp"], f"block {i}")
            require(block.attn, ["c_attn", "c_proj"], f"block {i} attn")
            require(block.mlp, ["c_fc", "c_proj", "act"], f"block {i} mlp")
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
        return (split_heads(q, self.heads, self.head_dim), split_heads(k, self.heads, self.head_dim),
                split_heads(v, self.heads, self.head_dim))

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        block = self._parts[1].h[i]
        x = x + self.attn_out[i](merge_heads(attended))
        return x + self.fc_out[i](block.mlp.act(self.fc_in[i](block.ln_2(x))))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        model, base = self._parts
        return model.lm_head(base.ln_f(x))
