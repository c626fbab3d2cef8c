"""Where each rank's file of an N-rank program lives: rank 0's is the FILE.pte a user names, rank r's
FILE.rank{r}.pte beside it (and, exported with external weights, each one's .ptd beside it, as for any program)."""

from __future__ import annotations

from pathlib import Path


def rank_file(pte: str | Path, rank: int) -> Path:
    pte = Path(pte)
    return pte if rank == 0 else pte.with_name(f"{pte.stem}.rank{rank}{pte.suffix}")
