"""Host reference for mlx::sample that reproduces the device's token ids.

It follows the device graph step for step in float32: NaN logits become -inf;
rows with temperature > 0 take argmax(logits / T + g) with Gumbel noise
g = -log(-log(u)) built from MLX's exact random bits; other rows (T <= 0 or
NaN) take argmax(logits). Bits and uniforms match MLX exactly; the two logs
are correctly rounded here but come from the platform's libm on the device
(glibc logf is off by one ulp for about 1% of inputs), so a token can differ
only when the best and second-best scores are within a few ulps: `margins`
reports that gap so a caller can tell such near-ties from real disagreements.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.mlx.custom_kernel_ops.reference import rng


def row_noise(batch: int, vocab: int, seed) -> np.ndarray:
    """The [batch, vocab] uniforms the device draws for this seed.

    A scalar seed draws one [batch, vocab] block from key(seed), so a row's noise
    depends on the batch size. A [batch] seed draws each row from its own key,
    exactly as that row would get when run alone with batch 1.
    """
    seed = torch.as_tensor(seed)
    if seed.dim() == 0:
        return rng.uniform((batch, vocab), int(seed))
    return np.stack([rng.uniform((vocab,), int(s)) for s in seed.tolist()])


def scores(logits: torch.Tensor, temperature: torch.Tensor, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scores of sampled rows, greedy mask) in the device's float order."""
    x = logits.detach().to(torch.float32).cpu().numpy()
    x = np.where(np.isnan(x), np.float32(-np.inf), x)
    t = torch.as_tensor(temperature).detach().to(torch.float32).cpu().numpy()
    t = np.broadcast_to(t.reshape(-1, 1) if t.ndim else t, (x.shape[0], 1))
    positive = t > 0
    safe_t = np.where(positive, t, np.float32(1)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        s = x / safe_t + rng.gumbel(uniforms)
    s = np.where(np.isnan(s), np.float32(-np.inf), s)
    return np.where(positive, s, x), ~positive[:, 0]


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, seed) -> torch.Tensor:
    tokens, _ = sample_with_margins(logits, temperature, seed)
    return tokens


def sample_with_margins(logits, temperature, seed) -> tuple[torch.Tensor, np.ndarray]:
    """Token ids [B] (int64) and, per row, the gap between the best and second-best score."""
    b, v = logits.shape
    s, _ = scores(logits, temperature, row_noise(b, v, seed))
    tokens = np.argmax(s, axis=-1)
    if v > 1:
        top2 = np.sort(np.where(np.isfinite(s), s, np.float32(-3e38)), axis=-1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
    else:
        margins = np.full(b, np.inf, dtype=np.float32)
    return torch.from_numpy(tokens.astype(np.int64)), margins
