"""Export a SamplingHead-wrapped model to a .pte, and call the result."""

from __future__ import annotations

import torch

from backends.mlx.export import ExportResult, export_to_pte
from backends.mlx.custom_kernel_ops.sample import check_sample_args
from backends.mlx.llm.sampling import GreedyHead, SamplingHead, last_position


class LogitsInput(torch.nn.Module):
    """A 'model' whose input is already the logits: exports the sampler by itself."""

    def forward(self, logits):
        return logits


def export_sampling_head(
    model: torch.nn.Module,
    example_args: tuple,
    *,
    seeded: bool = True,
    greedy_only: bool = False,
    per_row: bool = False,
    strict: bool = True,
) -> ExportResult:
    """Export `model` wrapped in SamplingHead (or GreedyHead).

    The program's inputs are example_args, then temperature, then seed (seeded only).
    With per_row, temperature and seed are [batch] tensors, one value per row.
    """
    if greedy_only:
        return export_to_pte(GreedyHead(model), example_args, strict=strict)
    with torch.no_grad():
        logits = last_position(model(*example_args))
    batch = logits.shape[0]
    shape = (batch,) if per_row else ()
    kwargs = {"temperature": torch.ones(shape)}
    if seeded:
        kwargs["seed"] = torch.zeros(shape, dtype=torch.int64)
    # Checked eagerly: inside a strict (dynamo) trace the same error arrives wrapped.
    check_sample_args(logits, kwargs["temperature"], kwargs.get("seed"))
    return export_to_pte(SamplingHead(model), example_args, kwargs, strict=strict)
