"""Export a causal LM as a tensor-parallel program: one file per rank, each rank's part of the model (shard.py)
traced and lowered on its own (the graphs are the same; the weights are the rank's), written and verified
together by rank_programs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from backends.mlx.llm.decoder.rank_programs import export_rank_parts
from backends.mlx.llm.distributed.split_options import check_split_options
from backends.mlx.llm.distributed.shard import check_shardable, shard_model


def export_tensor_parallel(model, out: Path, ranks: int, *, max_seq_len: int, verify: bool = True,
                           progress: Optional[Callable[[str], None]] = None, **export_options):
    """Write `ranks` files (`out` for rank 0, rank_file(out, r) for the others) from `model` (float or quantized),
    each with export_decoder(**export_options); rank 0's ExportResult. `verify`: run them together and check the
    greedy tokens against `model` (VerificationError, the files removed, on a mismatch)."""
    check_shardable(model, ranks)
    check_split_options("tensor_parallel", **export_options)
    return export_rank_parts(model, out, ranks, shard_model, max_seq_len=max_seq_len, verify=verify,
                             progress=progress, **export_options)
