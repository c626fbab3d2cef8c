"""Start the ranks of an N-rank (tensor- or pipeline-parallel) run on this host and watch them (what `etmlx
generate` does with an N-rank program when MLX's launcher has not already started it: no MLX_RANK in the
environment).

Every rank runs the same `etmlx` command with MLX_RANK set and MLX_HOSTFILE naming the ring's addresses (free
loopback ports in a temporary file, or --hostfile's): the runtime joins MLX's ring group at load. Rank 0's output
is the run's (it owns the terminal); the other ranks' stdout is dropped and their stderr kept for errors. Each
rank reports "ready" and then every token it produced to its own file in a temporary directory
(runtime/options.py RANK_LOG, written by RankProgress), which the launcher uses twice: as a heartbeat (no rank
reporting anything for `timeout` seconds ends the run: a hung rank blocks the others in their next collective)
(until every rank is ready, LOAD_TIMEOUT_S, at least `timeout`) and, at the end, to check that every rank produced the same tokens (the sampler runs on each rank from the same
logits and seed, so they must agree). A rank that exits with an error or dies ends the run at once: the others
are killed and one line says which rank and why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backends.mlx.llm.distributed.hosts import DEFAULT_STARTING_PORT, loopback_hosts, read_hostfile, ring_hostfile
from backends.mlx.runtime import options

DEFAULT_TIMEOUT_S = 120.0
# Until every rank has loaded its program (imports, weights, joining the group): loading is slower than a step.
LOAD_TIMEOUT_S = 600.0
POLL_S = 0.05


class RankFailure(RuntimeError):
    """A rank died, failed, hung, or disagreed with rank 0 (one line)."""


def in_group() -> bool:
    """Whether this process is already one rank of a group (started by this launcher, mlx.launch or by hand)."""
    return "MLX_RANK" in os.environ


def group_rank() -> int:
    value = os.environ.get("MLX_RANK", "0")
    if not value.isdigit():
        raise ValueError(f"MLX_RANK={value!r} is not a rank number")
    return int(value)


class RankProgress:
    """A rank's reports to its launcher (nothing when the rank was not started by it)."""

    def __init__(self):
        directory = options.rank_log()
        self._file = open(directory / f"rank{group_rank()}.log", "a") if directory is not None else None

    def say(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()


def _read_log(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    return lines[-1] if lines else ""


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"died ({signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with status {code}"


def run_ranks(argv: list[str], ranks: int, hostfile: Path | None = None, timeout: float = DEFAULT_TIMEOUT_S,
              starting_port: int = DEFAULT_STARTING_PORT) -> int:
    """Run `etmlx ARGV` as `ranks` ranks on this host; rank 0's exit status, or RankFailure (the others killed)."""
    hosts = read_hostfile(hostfile, ranks, starting_port) if hostfile is not None else loopback_hosts(ranks)
    if hostfile is not None:
        elsewhere = [(rank, host.ssh) for rank, host in enumerate(hosts) if host.ssh]
        if elsewhere:
            rank, name = elsewhere[0]
            # This launcher watches its ranks through files on this machine; mlx.launch starts them anywhere.
            raise ValueError(f"--hostfile {hostfile} puts rank {rank} on {name}: run ranks on other machines with "
                             f"`mlx.launch --hostfile {hostfile} -- etmlx ...` (etmlx serve starts them itself)")
    with tempfile.TemporaryDirectory(prefix="etmlx-ranks-") as tmp:
        directory = Path(tmp)
        ring = directory / "hosts.json"
        ring.write_text(ring_hostfile(hosts))
        procs = []
        try:
            for rank in range(ranks):
                env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(ring), **{options.RANK_LOG: tmp})
                err = None if rank == 0 else open(directory / f"rank{rank}.stderr", "w")
                procs.append(subprocess.Popen([sys.executable, "-m", "etmlx", *argv], env=env,
                                              stdout=None if rank == 0 else subprocess.DEVNULL, stderr=err))
                if err is not None:
                    err.close()
            _watch(procs, directory, timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        logs = [_read_log(directory / f"rank{r}.log") for r in range(ranks)]
        for rank in range(1, ranks):
            if logs[rank] != logs[0]:
                raise RankFailure(f"rank {rank} produced other tokens than rank 0 ({len(logs[rank])} vs "
                                  f"{len(logs[0])} reports): the ranks did not run the same steps")
        return procs[0].returncode


def _watch(procs: list, directory: Path, timeout: float) -> None:
    """Until every rank has exited: the first failure, or `timeout` s without any rank reporting, raises."""
    sizes, last = {}, time.monotonic()
    while True:
        codes = [proc.poll() for proc in procs]
        # A rank killed by a signal first: the ranks it leaves inside a collective may fail on their own after it.
        for rank, code in sorted(enumerate(codes), key=lambda rc: (rc[1] or 0) >= 0):
            if code is not None and code != 0:
                why = _last_line(directory / f"rank{rank}.stderr") if rank else ""
                raise RankFailure(f"rank {rank} of {len(procs)} {_status(code)}"
                                  + (f": {why}" if why else "") + "; the run is ended")
        if all(code == 0 for code in codes):
            return
        now = time.monotonic()
        for path in directory.glob("rank*.log"):
            size = path.stat().st_size
            if sizes.get(path) != size:
                sizes[path], last = size, now
        limit = timeout if len(sizes) == len(procs) else max(timeout, LOAD_TIMEOUT_S)
        if now - last > limit:
            waiting = [str(r) for r, code in enumerate(codes) if code is None]
            raise RankFailure(f"no rank made progress for {limit:g} s (rank(s) {', '.join(waiting)} still "
                              "running: one hangs or waits for a rank that does); the run is ended")
        time.sleep(POLL_S)
