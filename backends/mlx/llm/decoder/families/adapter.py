"""The adapter protocol between a transformers causal LM and StaticCacheLM, and the helpers adapters share.

An adapter splits one decoder block into the part before attention (norm, q/k/v projections, rotary
embedding) and the part after it (output projection, residual, MLP), so the cache module can own the
attention and the KV cache while every weight and norm stays the model's own. StaticCacheLM calls only
what `FamilyAdapter` declares; a new architecture is a new adapter module registered in `__init__.py`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

SUPPORTED = "Llama, Mistral, Qwen2, Qwen3 (model.layers with self_attn q/k/v/o_proj and mlp) and GPT-2"


class FamilyAdapter(Protocol):
    num_layers: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when fewer than heads)
    head_dim: int
    scale: float  # attention's softmax scale

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """[B, L] ids and positions -> hidden states [B, L, H] and what attention_in needs for positions
        (rotary cos/sin, or None)."""

    def attention_in(self, i: int, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to attention: q [B, heads, L, D], k and v [B, kv_heads, L, D], positions applied."""

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: residual stream x and attention's output [B, heads, L, D] -> next x."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: hidden [..., H] -> logits [..., V]."""


def require(owner: nn.Module, names, where: str) -> None:
    for name in names:
        if getattr(owner, name, None) is None:
            raise ValueError(f"{where} ({type(owner).__name__}) has no `{name}`: unsupported architecture "
                             f"(etmlx decodes {SUPPORTED})")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B, L, H * D]. contiguous() first: the attention output's traced strides
    would otherwise let the decomposed reshape become a view that fails for dynamic L."""
    batch, heads, length, dim = x.shape
    return x.transpose(1, 2).contiguous().view(batch, length, heads * dim)


def split_heads(x: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """[B, L, count * dim] -> [B, count, L, dim]"""
    batch, length = x.shape[:2]
    return x.view(batch, length, count, dim).transpose(1, 2)
