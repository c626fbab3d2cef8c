"""Export a causal LM as a pipeline-parallel program: one file per rank, rank r's holding its stage of the model
(pipeline.py: a contiguous block of layers; the embedding on rank 0, the final norm and head on the last rank),
written and verified together by rank_programs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from backends.mlx.llm.decoder.rank_programs import export_rank_parts
from backends.mlx.llm.distributed.split_options import check_split_options
from backends.mlx.llm.distributed.pipeline import check_pipelinable, stage_model


def export_pipeline_parallel(model, out: Path, ranks: int, *, max_seq_len: int, verify: bool = True,
                             progress: Optional[Callable[[str], None]] = None, **export_options):
    """Write `ranks` files (`out` for rank 0, rank_file(out, r) for the others), rank r's its stage of `model`
    (float or quantized), each with export_decoder(**export_options); rank 0's ExportResult. `verify`: run them
    together and check the greedy tokens against `model` (VerificationError, the files removed, on a mismatch)."""
    check_pipelinable(model, ranks)
    check_split_options("pipeline_parallel", **export_options)
    return export_rank_parts(model, out, ranks, stage_model, max_seq_len=max_seq_len, verify=verify,
                             progress=progress, **export_options)
