"""Export a SamplingHead-wrapped model to a .pte, and call the result."""

from __future__ import annotations

import torch

from backends.mlx.exporter.export import ExportResult, export_to_pte
from backends.mlx.custom_kernel_ops.sample import check_sample_args
from backends.mlx.llm.sampler.processing import check_knobs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import GreedyHead, SamplingHead, last_position


class LogitsInput(torch.nn.Module):
    """A 'model' whose input is already the logits: exports the sampler by itself."""

    def forward(self, logits):
        return logits


def knob_examples(config: SamplerConfig, batch: int, per_row: bool) -> dict:
    """Example values ("off" settings) for every knob, shaped as the program takes them."""
    shape = (batch,) if per_row else ()
    return {
        "top_k": torch.zeros(shape, dtype=torch.int64),
        "top_p": torch.ones(shape),
        "min_p": torch.zeros(shape),
        "bias_ids": torch.zeros((batch, config.logit_bias) if per_row else (config.logit_bias,), dtype=torch.int64),
        "bias_values": torch.zeros((batch, config.logit_bias) if per_row else (config.logit_bias,)),
        "presence_penalty": torch.zeros(shape),
        "frequency_penalty": torch.zeros(shape),
        "repetition_penalty": torch.ones(shape),
        "penalty_reset": torch.zeros(shape, dtype=torch.int64),
        "penalty_add": torch.full((batch, config.penalty_seed), -1, dtype=torch.int64),
    }


def export_sampling_head(
    model: torch.nn.Module,
    example_args: tuple,
    *,
    seeded: bool = True,
    greedy_only: bool = False,
    per_row: bool = False,
    strict: bool = True,
    config: SamplerConfig | None = None,
) -> ExportResult:
    """Export `model` wrapped in SamplingHead (or GreedyHead).

    The program's inputs are example_args, then temperature, then seed (seeded only), then
    the knobs of `config` in `config.knob_names()` order (see `sampler_inputs`). With
    per_row, temperature, seed and the knobs are [batch] tensors, one value per row.
    """
    if greedy_only:
        return export_to_pte(GreedyHead(model), example_args, strict=strict)
    with torch.no_grad():
        logits = last_position(model(*example_args))
    batch = logits.shape[0]
    shape = (batch,) if per_row else ()
    config = config or SamplerConfig()
    kwargs = {"temperature": torch.ones(shape)}
    if seeded:
        kwargs["seed"] = torch.zeros(shape, dtype=torch.int64)
    examples = knob_examples(config, batch, per_row)
    for name in config.knob_names():
        kwargs[name] = examples[name]
    # Checked eagerly: inside a strict (dynamo) trace the same error arrives wrapped.
    check_sample_args(logits, kwargs["temperature"], kwargs.get("seed"))
    check_knobs(config, logits, {n: kwargs.get(n) for n in examples})
    head = SamplingHead(model, config, batch=batch, vocab=logits.shape[1])
    return export_to_pte(head, example_args, kwargs, strict=strict)


def check_values(config: SamplerConfig, temperature, vocab: int | None = None, **knobs) -> None:
    """Reject knob values outside their documented ranges (the device would clamp them)."""

    def values(name, t):
        v = torch.as_tensor(t).detach().double().reshape(-1)
        if bool(torch.isnan(v).any()):
            raise ValueError(f"{name} contains NaN")
        return v

    if bool((values("temperature", temperature) < 0).any()):
        raise ValueError("temperature must be >= 0 (0 = greedy)")
    if "top_k" in knobs and bool((values("top_k", knobs["top_k"]) < 0).any()):
        raise ValueError("top_k must be >= 0 (0 = off)")
    if "top_p" in knobs:
        p = values("top_p", knobs["top_p"])
        if bool(((p <= 0) | (p > 1)).any()):
            raise ValueError("top_p must be in (0, 1] (1 = off)")
    if "min_p" in knobs:
        m = values("min_p", knobs["min_p"])
        if bool(((m < 0) | (m > 1)).any()):
            raise ValueError("min_p must be in [0, 1] (0 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        if name in knobs:
            values(name, knobs[name])
    if "repetition_penalty" in knobs and bool((values("repetition_penalty", knobs["repetition_penalty"]) <= 0).any()):
        raise ValueError("repetition_penalty must be > 0 (1 = off)")
    if "bias_values" in knobs:
        b = values("bias_values", knobs["bias_values"])
        if bool(((b < -100) | (b > 100)).any()):
            raise ValueError("bias_values must be in [-100, 100] (OpenAI's logit_bias range)")
    if "penalty_add" in knobs:
        add = torch.as_tensor(knobs["penalty_add"])
        if add.numel() and bool(((add[..., 1:] >= 0) & (add[..., :-1] < 0)).any()):
            raise ValueError("penalty_add must be left-aligned: ids first, -1 only as trailing padding")
        if vocab is not None and bool((add >= vocab).any()):
            raise ValueError(f"penalty_add ids must be < {vocab}")
    if "bias_ids" in knobs and vocab is not None:
        ids = torch.as_tensor(knobs["bias_ids"])
        if bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"bias_ids must be token ids in [0, {vocab})")


def sampler_inputs(config: SamplerConfig, model_args, temperature, seed=None, *, vocab: int | None = None,
                   validate: bool = True, **knobs) -> list:
    """The runtime input list of an export_sampling_head program, in its order.

    With `validate` (the default) values outside their documented ranges raise ValueError;
    pass validate=False to send them anyway (the device then clamps as documented)."""
    unknown = set(knobs) - set(config.knob_names())
    if unknown:
        raise ValueError(f"knobs not in this program: {sorted(unknown)}")
    missing = [n for n in config.knob_names() if n not in knobs]
    if missing:
        raise ValueError(f"missing knobs: {missing}")
    if validate:
        check_values(config, temperature, vocab, **knobs)
    inputs = [*model_args, temperature]
    if seed is not None:
        inputs.append(seed)
    return inputs + [knobs[n] for n in config.knob_names()]
