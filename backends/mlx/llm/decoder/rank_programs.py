"""Export a program split over ranks (tensor_parallel.py, pipeline_parallel.py): one file per rank
(rank_files.py), each rank's part of the model traced and lowered on its own, all recorded under one group id so
the runtime refuses files of different exports together.

A rank cannot run alone (its collectives need the others), so the export's check runs them together: the ranks
are started over the loopback (launch.py) for a greedy decode of verify.py's prompt, and each token is checked
against the whole eager model's (verify.check_continuation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from backends.mlx.exporter.export import weights_path
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_reference import KvCacheReference
from backends.mlx.llm.decoder.verify import (DECODE_STEPS, PROMPT_TOKENS, VerificationError, VerificationReport,
                                             activation_dtype, check_continuation, is_quantized, verification_prompt)
from backends.mlx.llm.distributed.rank_files import rank_file

VERIFY_TIMEOUT_S = 600


def export_rank_parts(model, out: Path, ranks: int, part: Callable[[nn.Module, int, int], nn.Module], *,
                      max_seq_len: int, verify: bool = True, progress: Optional[Callable[[str], None]] = None,
                      **export_options):
    """Write `ranks` files (`out` for rank 0, rank_file(out, r) for the others), rank r's holding
    part(model, r, ranks) exported with export_decoder(**export_options); rank 0's ExportResult. `verify`: run
    them together and check the greedy tokens against `model` (VerificationError, the files removed, on a
    mismatch)."""
    say = progress or (lambda _stage: None)
    out = Path(out)
    group_id = uuid.uuid4().hex
    results = []
    for rank in range(ranks):
        say(f"rank {rank} of {ranks}: splitting and exporting")
        module = part(model, rank, ranks).eval()
        results.append(export_decoder(module, rank_file(out, rank), max_seq_len, progress=say, verify=False,
                                      rank=(rank, ranks, group_id), **export_options))
        del module
    if verify:
        say(f"verifying the {ranks} ranks together against the eager model")
        kv_bits = export_options.get("kv_bits") or 0
        # A quantized cache's reference is the eager model over the same quantized cache (as one rank's export).
        reference = KvCacheReference(model, kv_bits, export_options.get("kv_group_size", 64),
                                     export_options.get("kv_scale_dtype", "")) if kv_bits else model
        try:
            say(_verified(reference, out, ranks).summary())
        except VerificationError as exc:
            for rank in range(ranks):
                for path in (rank_file(out, rank), weights_path(rank_file(out, rank))):
                    path.unlink(missing_ok=True)
            raise VerificationError(f"{exc}; removed the {ranks} rank files (verify=False / --no-verify keeps "
                                    "them)") from None
    return results[0]


def rank_tokens(pte: Path, prompt: list[int], max_tokens: int, timeout: float = VERIFY_TIMEOUT_S,
                extra: tuple[str, ...] = ()) -> list[int]:
    """`etmlx generate --json` of the N-rank program `pte` (greedy unless `extra` says otherwise): its token ids."""
    cmd = [sys.executable, "-m", "etmlx", "generate", str(pte), "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(max_tokens), "--json", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}  # start a group of its own
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise VerificationError(f"{pte}: the ranks did not run ({lines[-1] if lines else done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens"]


def _verified(model, out: Path, ranks: int) -> VerificationReport:
    config = getattr(model.config, "text_config", model.config)
    prompt = verification_prompt(config.vocab_size, PROMPT_TOKENS)
    tokens = rank_tokens(out, prompt, 1 + DECODE_STEPS)
    dtype = str(activation_dtype(model)).replace("torch.", "")
    report = VerificationReport(steps=0, dtype=dtype, quantized=is_quantized(model))
    check_continuation(model, out, prompt, tokens, report, "step", f"({ranks} ranks) decodes differently from the "
                       "eager model")
    return report
