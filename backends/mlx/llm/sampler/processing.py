"""The sampler pipeline in torch ops and etmlx custom ops (order: config.py's module docstring).

Traced by torch.export it becomes the device program; run eagerly it is the host
reference (its custom ops' CPU implementations reproduce the device, and the rest
is float32 elementwise arithmetic, which rounds identically on both).
"""

from __future__ import annotations

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::sample_fused, mlx::filter_threshold)
from backends.mlx.custom_kernel_ops.allowed_mask import NO_ALLOWED_TOKEN, unpack_mask  # noqa: F401  (re-exported)
from backends.mlx.custom_kernel_ops.filter_threshold import divide_by_temperature
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import KNOBS, enabled, width

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check_row_knob(name, value, batch, dtypes):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {value.dtype}")
    if not (value.dim() == 0 or (value.dim() == 1 and value.shape[0] == batch)):
        raise ValueError(f"{name} must be a scalar or [batch={batch}], got shape {tuple(value.shape)}")


def check_knobs(config: SamplerConfig, logits: torch.Tensor, knobs: dict) -> None:
    """Every knob the config enables is given with the right dtype and shape; no other is."""
    batch, vocab = logits.shape
    names = set(config.knob_names())
    for name, value in knobs.items():
        if name not in names and value is not None:
            raise ValueError(f"{name} was given but the sampler was not configured with it")
    for name in names:
        if knobs.get(name) is None:
            raise ValueError(f"{name} is required: the sampler was configured with it")
    for knob in KNOBS:
        if knob.feature is None or not enabled(knob, config):
            continue
        for i in knob.program_inputs:
            # A 0/1 knob (penalty_reset) may also be a bool tensor.
            dtypes = _FLOATS if i.dtype == "float32" else _INTS + ((torch.bool,) if (knob.low, knob.high) == (0, 1)
                                                                   else ())
            if not knob.width:
                _check_row_knob(i.name, knobs[i.name], batch, dtypes)
                continue
            t, n = knobs[i.name], width(knob, config, vocab)
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
                raise TypeError(f"{i.name} must be a tensor with dtype in {[str(d) for d in dtypes]}")
            shapes = ((batch, n),) if knob.rows_only else ((n,), (batch, n))
            if tuple(t.shape) not in shapes:
                raise ValueError(f"{i.name} must be {' or '.join(str(list(s)) for s in shapes)}, got {tuple(t.shape)}")
    if config.logprobs > vocab:
        raise ValueError(f"logprobs={config.logprobs} exceeds the vocabulary ({vocab})")


def _rows(t: torch.Tensor, batch: int, dtype) -> torch.Tensor:
    return t.to(dtype).reshape(-1).expand(batch)


def apply_logit_bias(x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    batch, vocab = x.shape
    ids = ids.to(torch.int64).expand(batch, -1)
    values = values.to(torch.float32).expand(batch, -1)
    valid = (ids >= 0) & (ids < vocab)  # out-of-range ids are ignored, never clamped onto a real token
    return x.scatter_add(1, ids.clamp(0, vocab - 1), torch.where(valid, values, torch.zeros_like(values)))


def counts_for_step(counts: torch.Tensor, reset: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """The counts this step uses: rows reset to zero where asked, then `add` ids counted (-1 skipped)."""
    batch, vocab = counts.shape
    keep = (reset.reshape(-1).expand(batch) == 0).unsqueeze(1)
    c = torch.where(keep, counts, torch.zeros_like(counts))
    if add is not None:
        valid = (add >= 0) & (add < vocab)
        c = c.scatter_add(1, add.to(torch.int64).clamp(0, vocab - 1), valid.to(torch.int32))
    return c


def window_for_step(window: torch.Tensor, reset: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """The recent-token window this step uses (oldest first, -1 = empty): rows reset where asked,
    then the `add` ids appended (left-aligned, -1 padding), keeping the last W."""
    batch, width = window.shape
    keep = (reset.reshape(-1).expand(batch) == 0).unsqueeze(1)
    w = torch.where(keep, window, torch.full_like(window, -1))
    if add is None:
        return w
    add = add.to(torch.int64)
    added = (add >= 0).sum(1, keepdim=True)
    history = torch.cat([w, add], 1)
    return history.gather(1, added + torch.arange(width).unsqueeze(0))


def counts_of_window(window: torch.Tensor, vocab: int) -> torch.Tensor:
    valid = (window >= 0) & (window < vocab)
    zeros = torch.zeros(window.shape[0], vocab, dtype=torch.int32)
    return zeros.scatter_add(1, window.clamp(0, vocab - 1), valid.to(torch.int32))


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, presence, frequency, repetition) -> torch.Tensor:
    batch = x.shape[0]
    seen = counts > 0
    r = _rows(repetition, batch, torch.float32).unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    f = _rows(frequency, batch, torch.float32).unsqueeze(1)
    p = _rows(presence, batch, torch.float32).unsqueeze(1)
    return x - counts.to(torch.float32) * f - seen.to(torch.float32) * p


def process_and_sample(config: SamplerConfig, logits: torch.Tensor, temperature, seed, knobs: dict,
                       counts_state: torch.Tensor | None = None):
    batch = logits.shape[0]
    x = logits.to(torch.float32)
    counts = window = None
    vocab = logits.shape[1]
    if config.penalties and config.penalty_window:
        window = window_for_step(counts_state, knobs["penalty_reset"], knobs["penalty_add"])
        counts = counts_of_window(window, vocab)
    elif config.penalties:
        counts = counts_for_step(counts_state, knobs["penalty_reset"], knobs["penalty_add"])
    if counts is not None:
        x = apply_penalties(x, counts, knobs["presence_penalty"], knobs["frequency_penalty"],
                            knobs["repetition_penalty"])
    if config.logit_bias:
        x = apply_logit_bias(x, knobs["bias_ids"], knobs["bias_values"])
    if config.allowed_mask:
        x = torch.ops.mlx.allowed_mask(x, knobs["allowed_mask"].to(torch.int32))
    t = _rows(temperature, batch, torch.float32)
    thr = None
    if config.filters:
        row = lambda name, dt: _rows(knobs[name], batch, dt) if getattr(config, name) else None
        thr = torch.ops.mlx.filter_threshold(x, t, row("top_k", torch.int64), row("top_p", torch.float32),
                                             row("min_p", torch.float32), config.candidates)
    tokens = torch.ops.mlx.sample_fused(x, t, seed, thr)
    extra = ()
    if window is not None:
        window = torch.cat([window, tokens.unsqueeze(1)], 1)[:, 1:]
        counts_state.copy_(window)
        extra = (counts_of_window(window, vocab),) if config.expose_counts else ()
    elif counts is not None:
        counts = counts.scatter_add(1, tokens.unsqueeze(1), torch.ones_like(tokens, dtype=torch.int32).unsqueeze(1))
        counts_state.copy_(counts)
        extra = (counts.clone(),) if config.expose_counts else ()  # a separate tensor from the state
    out = tokens
    if config.allowed_mask:  # the counts and logprobs index with the drawn id, which -1 cannot
        out = torch.ops.mlx.drawn_or_none(tokens, x)
    if not config.logprobs:
        return (out, *extra) if extra else out
    if config.logprobs_mode == "raw":
        scores = logits.to(torch.float32)
    else:
        scores = divide_by_temperature(x, t)
        if thr is not None:
            scores = torch.where(scores >= thr, scores, torch.full_like(scores, float("-inf")))
    scores = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    dist = torch.log_softmax(scores, dim=-1)
    chosen = dist.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = torch.topk(dist, config.logprobs, dim=-1)
    return (out, chosen, top_ids, top_logprobs, *extra)
