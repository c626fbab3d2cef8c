"""torch.ops.mlx.allowed_mask(x, words) -> [B, V] float32: x where the packed mask allows, -inf elsewhere.

`words` [B, ceil(V/32)] int32: bit j of word i allows token 32 i + j (llguidance's and xgrammar's
layout; all ones = unconstrained; bits past V are ignored). One op rather than the unpack/where
composition so the runtime can lower it to AllowedMaskNode, whose CPU kernel returns x untouched
for an all-ones row instead of unpacking V bits (the common, unconstrained case costs ~0).
This CPU implementation is the host reference: a select, bit-identical to the device.
"""

from __future__ import annotations

import torch

# Bit j of a 32-bit word, as int32 (bit 31 is the sign bit).
_BITS = [1 << j if j < 31 else -(1 << 31) for j in range(32)]


def unpack_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 words -> [B, V] bool (bits past V ignored)."""
    bits = torch.tensor(_BITS, dtype=torch.int32)
    allowed = (words.to(torch.int32).unsqueeze(-1) & bits) != 0
    return allowed.reshape(words.shape[0], -1)[:, :vocab]


def _check(x: torch.Tensor, words: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be a [batch, vocab] float32 tensor, got {tuple(x.shape)} {x.dtype}")
    need = (x.shape[1] + 31) // 32
    if words.dtype != torch.int32 or words.dim() != 2 or words.shape[1] != need or words.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"allowed_mask must be [{x.shape[0]}, {need}] int32, got {tuple(words.shape)} {words.dtype}")


@torch.library.custom_op("mlx::allowed_mask", mutates_args=())
def allowed_mask(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    _check(x, words)
    allowed = unpack_mask(words, x.shape[1]).expand(x.shape[0], -1)
    return torch.where(allowed, x, torch.full_like(x, float("-inf")))


@allowed_mask.register_fake
def _allowed_mask_fake(x, words):
    _check(x, words)
    return torch.empty_like(x)


NO_ALLOWED_TOKEN = -1  # the token id of a row whose mask allows no token


@torch.library.custom_op("mlx::drawn_or_none", mutates_args=())
def drawn_or_none(tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """tokens [B] int64 drawn from the masked scores x [B, V]: each row's token, or NO_ALLOWED_TOKEN where
    x[r, token] is -inf. Gumbel-max and greedy pick a token above -inf whenever the row has one, so this
    reads B values, not V. One op so the CPU runtime answers it on the host (DrawnOrNoneNode): a lazy
    tail after the sampler would cost one more graph evaluation per step."""
    drawn = x.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.where(drawn > float("-inf"), tokens, torch.full_like(tokens, NO_ALLOWED_TOKEN))


@drawn_or_none.register_fake
def _drawn_or_none_fake(tokens, x):
    return torch.empty_like(tokens)


__all__ = ["allowed_mask", "drawn_or_none", "unpack_mask", "NO_ALLOWED_TOKEN"]
