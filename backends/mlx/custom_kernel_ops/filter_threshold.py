"""torch.ops.mlx.filter_threshold(x, temperature, top_k, top_p, min_p, candidates) -> [B, 1] float32.

Per row, the threshold of top-k / top-p / min-p over the scores z = x / t (t = 1 for rows
with t <= 0): tokens with z >= threshold are kept (semantics in schema.fbs, FilterThresholdNode).
The device sorts only the best `candidates` scores unless a row needs more; the CPU
implementation is the host reference and sorts whole rows, which gives the same values.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def _f32_log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x.astype(np.float64)).astype(np.float32)


def _logsumexp_f32(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    safe_m = np.where(np.isfinite(m), m, np.float32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.exp((x - safe_m).astype(np.float64)).astype(np.float32).sum(axis=1, keepdims=True, dtype=np.float32)
        return np.where(np.isfinite(m), safe_m + _f32_log(s), m).astype(np.float32)


def threshold_reference(z, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    z = np.asarray(z, dtype=np.float32)
    rows, vocab = z.shape
    col = lambda a, dt: None if a is None else np.asarray(a).astype(dt).reshape(-1, 1) * np.ones((rows, 1), dt)
    k, p, mp = col(top_k, np.int64), col(top_p, np.float32), col(min_p, np.float32)
    m = z.max(axis=1, keepdims=True)
    thr = np.full((rows, 1), -np.inf, np.float32)
    if mp is not None:
        mp = np.clip(mp, 0, 1)
        with np.errstate(invalid="ignore"):
            thr = np.maximum(thr, np.where(mp > 0, m + _f32_log(mp), np.float32(-np.inf)))
    if k is not None or p is not None:
        vals = -np.sort(-z, axis=1)
        tau_k = np.full((rows, 1), -np.inf, np.float32)
        if k is not None:
            active = (k > 0) & (k < vocab)
            idx = np.clip(np.where(active, k, vocab) - 1, 0, vocab - 1)
            tau_k = np.where(active, np.take_along_axis(vals, idx, 1), np.float32(-np.inf))
        thr = np.maximum(thr, tau_k)
        if p is not None:
            with np.errstate(invalid="ignore"):
                active_p = p < 1
            lse = _logsumexp_f32(np.where(z >= tau_k, z, np.float32(-np.inf)))
            with np.errstate(invalid="ignore", over="ignore"):
                q = np.exp((vals - lse).astype(np.float64)).astype(np.float32)
            cum = np.cumsum(q, axis=1, dtype=np.float32)
            with np.errstate(invalid="ignore"):
                first = np.clip((cum < p).sum(axis=1, keepdims=True), 0, vocab - 1)
            thr = np.maximum(thr, np.where(active_p, np.take_along_axis(vals, first, 1), np.float32(-np.inf)))
    return np.minimum(thr, m).astype(np.float32)


def divide_by_temperature(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z = x / t in float32, one t per row (scalar broadcast), t = 1 for greedy rows (t <= 0 or NaN)."""
    t = temperature.to(torch.float32).reshape(-1).expand(x.shape[0])
    return x.to(torch.float32) / torch.where(t > 0, t, torch.ones_like(t)).unsqueeze(1)


def scaled_scores(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """divide_by_temperature with NaN as -inf, as the device computes the scores it filters."""
    z = divide_by_temperature(x, temperature)
    return torch.where(torch.isnan(z), torch.full_like(z, float("-inf")), z)


@torch.library.custom_op("mlx::filter_threshold", mutates_args=())
def filter_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                     top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor], candidates: int = 256) -> torch.Tensor:
    as_np = lambda t: None if t is None else t.detach().cpu().numpy()
    out = threshold_reference(scaled_scores(x, temperature).numpy(), as_np(top_k), as_np(top_p), as_np(min_p))
    return torch.from_numpy(out)


@filter_threshold.register_fake
def _filter_threshold_fake(x, temperature, top_k, top_p, min_p, candidates=256):
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be a [batch, vocab] float32 tensor, got {tuple(x.shape)} {x.dtype}")
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    return x.new_empty((x.shape[0], 1))
