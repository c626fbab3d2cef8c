"""Export a SamplingHead-wrapped model to a .pte, and call the result."""

from __future__ import annotations

import torch

from backends.mlx.exporter.export import ExportResult, export_to_pte
from backends.mlx.custom_kernel_ops.sample import check_sample_args
from backends.mlx.llm.sampler.processing import check_knobs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import GreedyHead, SamplingHead, last_position
from backends.mlx.llm.sampler.knobs import BY_NAME, INT64_MAX, KNOBS, enabled, width


class LogitsInput(torch.nn.Module):
    """A 'model' whose input is already the logits: exports the sampler by itself."""

    def forward(self, logits):
        return logits


def knob_examples(config: SamplerConfig, batch: int, per_row: bool, vocab: int | None = None) -> dict:
    """Example values (the off values) for every knob input of the table, shaped as the program takes them."""
    examples = {}
    for knob in KNOBS:
        if knob.feature is None or (knob.words and vocab is None):
            continue  # temperature and seed: the callers give their examples; a bitmask needs the vocabulary
        rows = (batch,) if per_row or knob.rows_only else ()
        shape = rows + ((width(knob, config, vocab),) if knob.width else ())
        for i in knob.program_inputs:
            examples[i.name] = torch.full(shape, i.off, dtype=getattr(torch, i.dtype))
    return examples


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
    examples = knob_examples(config, batch, per_row, logits.shape[1])
    for name in config.knob_names():
        kwargs[name] = examples[name]
    # Checked eagerly: inside a strict (dynamo) trace the same error arrives wrapped.
    check_sample_args(logits, kwargs["temperature"], kwargs.get("seed"))
    check_knobs(config, logits, {n: kwargs.get(n) for n in examples})
    head = SamplingHead(model, config, batch=batch, vocab=logits.shape[1])
    return export_to_pte(head, example_args, kwargs, strict=strict)


def check_values(config: SamplerConfig, temperature, vocab: int | None = None, **knobs) -> None:
    """Reject knob values outside their ranges in the table (the device would clamp them)."""

    def values(name, t):
        v = torch.as_tensor(t).detach().double().reshape(-1)
        if bool(torch.isnan(v).any()):
            raise ValueError(f"{name} contains NaN")
        return v

    def in_range(knob, name, t):
        v = values(name, t)
        low, high = knob.low, knob.high
        bad = torch.zeros_like(v, dtype=torch.bool)
        if low is not None:
            bad |= (v <= low) if knob.low_open else (v < low)
        if high is not None and not (knob.integer and high == INT64_MAX):  # an int64 tensor cannot exceed it
            bad |= (v >= high) if knob.high_open else (v > high)
        if bool(bad.any()):
            raise ValueError(f"{name} must be {knob.range_text()}")

    in_range(BY_NAME["temperature"], "temperature", temperature)
    for knob in KNOBS:
        if knob.feature is None or not enabled(knob, config):
            continue
        if not knob.inputs:
            if knob.name in knobs:
                in_range(knob, knob.name, knobs[knob.name])
            continue
        ids_input, values_input = knob.inputs  # a pair: token ids and their values
        if values_input.name in knobs:
            in_range(knob, values_input.name, knobs[values_input.name])
        if ids_input.name in knobs and vocab is not None:
            ids = torch.as_tensor(knobs[ids_input.name])
            if bool(((ids < ids_input.off) | (ids >= vocab)).any()):
                raise ValueError(f"{ids_input.name} must be token ids in [0, {vocab}) ({ids_input.off} = none)")
    if "penalty_add" in knobs:
        add = torch.as_tensor(knobs["penalty_add"])
        if add.numel() and bool(((add[..., 1:] >= 0) & (add[..., :-1] < 0)).any()):
            raise ValueError("penalty_add must be left-aligned: ids first, -1 only as trailing padding")
        if vocab is not None and bool((add >= vocab).any()):
            raise ValueError(f"penalty_add ids must be < {vocab}")


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
