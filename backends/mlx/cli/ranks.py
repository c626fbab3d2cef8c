"""`etmlx generate` on an N-rank (tensor- or pipeline-parallel) program (llm/distributed/): outside a rank group
it starts the program's ranks on this host and returns rank 0's result (llm/distributed/launch.py); inside one
(started by that launcher, mlx.launch, or MLX_RANK/MLX_HOSTFILE set by hand) it runs this process's rank file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.distributed.launch import RankFailure, RankProgress, group_rank, in_group, run_ranks
from backends.mlx.llm.distributed.rank_files import rank_file


@dataclass
class RankProgram:
    ranks: int
    file: Path  # this process's rank file

    def progress(self) -> RankProgress:
        progress = RankProgress()
        progress.say("ready")
        return progress


def rank_program(pte: Path, args) -> RankProgram | None:
    """The N-rank program at `pte` (its rank 0's file), or None for a one-rank program."""
    try:
        meta = DecoderMeta.load(pte)
    except (FileNotFoundError, ValueError):  # not a decoder program: the decoder's load says so
        meta = None
    ranks = meta.ranks if meta is not None else 1
    if ranks == 1:
        if getattr(args, "hostfile", None):
            raise ValueError(f"--hostfile: {pte} is a one-rank program")
        return None
    if getattr(args, "draft_model", None) and getattr(args, "draft_model_cost", None) is None:
        # Each rank runs this loop on its own: a draft count chosen from measured times could differ between ranks,
        # whose calls must match. A fixed cost makes every rank choose the same counts.
        raise ValueError(f"--draft-model on the {ranks}-rank program {pte} needs --draft-model-cost C (each rank "
                         "must choose the same draft counts)")
    if meta.rank != 0:
        raise ValueError(f"{pte} is rank {meta.rank}'s file of a {ranks}-rank program: run rank 0's file (the one "
                         "without .rankN)")
    rank = group_rank() if in_group() else 0
    if rank >= ranks:
        raise ValueError(f"MLX_RANK={rank}, but {pte} is a {ranks}-rank program")
    file = rank_file(pte, rank)
    if not file.is_file():
        raise FileNotFoundError(f"{file} (rank {rank}'s part of {pte}) does not exist")
    return RankProgram(ranks, file)


def start_ranks(program: RankProgram, args) -> bool:
    """Outside a rank group: runs the command as the program's ranks and returns True (rank 0 printed the output).
    Inside one: False (this process is a rank: run it)."""
    if in_group():
        return False
    hostfile = Path(args.hostfile) if getattr(args, "hostfile", None) else None
    try:
        code = run_ranks(args.argv, program.ranks, hostfile, args.rank_timeout, args.starting_port)
    except RankFailure as exc:
        raise OSError(str(exc)) from None
    if code != 0:
        raise OSError(f"rank 0 exited with status {code}")
    return True
