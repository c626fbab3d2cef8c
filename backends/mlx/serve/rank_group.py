"""An N-rank (tensor-parallel) program served as one program: one program worker per rank, fed the same calls.

`etmlx serve` of rank 0's file starts the ranks on this host (ring over the loopback on free ports), or where
--hostfile says (llm/distributed/hosts.py; a rank on another machine through ssh, llm/distributed/remote.py, its
worker's pipes carried by the ssh connection): rank r's worker (serve/program_worker.py) loads FILE.rankR.pte with
MLX_RANK=r, and the runtime joins MLX's group at load. The server process stays the front: it tokenizes, builds every call's inputs
(prompt tokens, positions, sampling values, seeds, row resets, masks) once, and the group writes the same frame
to every rank's worker, so every rank runs the same steps, and cache copies between rows go to every rank too.
Each rank samples from the same all-summed logits; the group reads every rank's reply and checks that the
integer outputs (the tokens) agree with rank 0's, whose outputs the engine gets.

Faults: the replies are read from all ranks at once, so a rank that exits (kill -9, a crash) is seen at once
even while the others wait for it inside a collective; a call not answered by every rank within the deadline
(--rank-timeout, --step-timeout: a stopped or hung rank blocks the others in their next all-sum) fails too. Either
way every rank is killed and WorkerDied raised: the engine fails the rows of that call and the supervisor
(serve/supervisor.py) starts a new group. A rank that cannot load (another rank's or another export's file,
refused by the runtime) ends the start with that rank's one-line reason.
"""

from __future__ import annotations

import os
import pickle
import select
import shlex
import tempfile
import time
from pathlib import Path

import torch

from backends.mlx.llm.distributed.hosts import DEFAULT_SSH, RankHost, loopback_hosts, ring_hostfile
from backends.mlx.llm.distributed.launch import LOAD_TIMEOUT_S
from backends.mlx.llm.distributed.remote import RemoteRank
from backends.mlx.llm.distributed.rank_files import rank_file
from backends.mlx.serve.program_worker import _HEADER, ProgramWorker, WorkerDied, _decode, _encode


class RankGroup:
    """`execute(inputs) -> outputs` (rank 0's), like a ProgramWorker, run by `ranks` workers together."""

    def __init__(self, pte: Path, ranks: int, step_timeout: float | None = None,
                 hosts: list[RankHost] | None = None, ssh: list[str] | None = None,
                 load_timeout: float = LOAD_TIMEOUT_S):
        """hosts: where each rank runs (llm/distributed/hosts.py; default: this machine, free loopback ports);
        a rank on another machine is started there with `ssh` (default: ssh)."""
        pte = Path(pte)
        self.ranks = ranks
        self.step_timeout = step_timeout
        hosts = hosts if hosts is not None else loopback_hosts(ranks)
        if len(hosts) != ranks:
            raise ValueError(f"{len(hosts)} rank hosts given for a {ranks}-rank program")
        files = [rank_file(pte, rank) for rank in range(ranks)]
        for rank, file in enumerate(files):
            if hosts[rank].ssh is None and not file.is_file():  # another machine's copy is checked there
                raise FileNotFoundError(f"{file} (rank {rank}'s part of {pte}) does not exist")
        self._tmp = tempfile.TemporaryDirectory(prefix="etmlx-serve-ranks-")
        ring_text = ring_hostfile(hosts)  # a local rank reads it from a file, a remote one gets the text
        ring = Path(self._tmp.name) / "hosts.json"
        ring.write_text(ring_text)
        ssh = ssh or shlex.split(DEFAULT_SSH)
        self.workers: list[ProgramWorker] = []
        try:
            for rank, (file, host) in enumerate(zip(files, hosts)):
                env = {"MLX_RANK": str(rank)}
                remote = None
                if host.ssh is not None:
                    remote = RemoteRank(host.ssh, ring_text, ssh)
                else:
                    env["MLX_HOSTFILE"] = str(ring)
                self.workers.append(ProgramWorker(file, env=env, wait=False, remote=remote))
            replies = self._gather(load_timeout, "loading", stop_on_error=True)
            failed = [(rank, payload.decode()) for rank, (kind, payload) in enumerate(replies) if kind == b"e"]
            if failed:
                rank, message = failed[0]
                raise ValueError(f"rank {rank} of {ranks}: {message}")
            for worker, (kind, payload) in zip(self.workers, replies):
                worker.loaded(kind, payload)
        except WorkerDied as exc:  # a rank exited or hung while loading (already killed, the others too)
            raise OSError(str(exc)) from None
        except BaseException:
            self.kill()
            raise
        self.can_copy_rows = all(worker.can_copy_rows for worker in self.workers)

    @property
    def pid(self) -> int:
        return self.workers[0].pid

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    def alive(self) -> bool:
        return all(worker.alive() for worker in self.workers)

    def _gather(self, timeout: float | None, what: str, stop_on_error: bool = False) -> list[tuple[bytes, bytes]]:
        """Every rank's next reply frame, read from all pipes at once (stop_on_error: only until one is an
        error). A rank whose pipe closes, or no reply from some rank within `timeout` s: every rank is killed
        and WorkerDied names the first rank at fault."""
        deadline = None if timeout is None else time.monotonic() + timeout
        buffers = {worker.fileno(): bytearray() for worker in self.workers}
        rank_of = {worker.fileno(): rank for rank, worker in enumerate(self.workers)}
        replies: dict[int, tuple[bytes, bytes]] = {}
        while len(replies) < self.ranks:
            pending = [fd for fd, rank in rank_of.items() if rank not in replies]
            wait = None if deadline is None else deadline - time.monotonic()
            ready = select.select(pending, [], [], max(wait, 0.0))[0] if wait is None or wait > 0 else []
            if not ready:
                late = ", ".join(str(rank_of[fd]) for fd in pending)
                self.kill()
                # A rank that hangs holds the others in their next collective: which one is at fault is unknown.
                raise WorkerDied(f"no answer from rank(s) {late} of {self.ranks} within {timeout:g} s while {what} "
                                 "(one hangs or waits for a rank that does); the rank group was stopped")
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                rank = rank_of[fd]
                if not chunk:
                    status = self.workers[rank].exit_status(wait=5.0)
                    self.kill()
                    raise WorkerDied(f"rank {rank} of {self.ranks} exited ({status}) while {what}; the rank group "
                                     "was stopped")
                buffer = buffers[fd]
                buffer += chunk
                if len(buffer) >= _HEADER.size:
                    size = _HEADER.unpack_from(buffer)[0]
                    if len(buffer) >= _HEADER.size + size:  # one reply per request: nothing follows it
                        body = bytes(buffer[_HEADER.size:_HEADER.size + size])
                        replies[rank] = (body[:1], body[1:])
                        if stop_on_error and body[:1] == b"e":  # the others may wait for it forever
                            return [replies.get(r, (b"", b"")) for r in range(self.ranks)]
        return [replies[rank] for rank in range(self.ranks)]

    def _call(self, kind: bytes, payload: bytes, what: str, failure: str) -> list[tuple[bytes, bytes]]:
        """Every rank's reply to one frame. what: the step, for fault messages; failure: how a call that failed
        on every rank alike is reported (the words a single worker uses)."""
        for rank, worker in enumerate(self.workers):
            try:
                worker.send(kind, payload)
            except WorkerDied:
                self.kill()
                raise WorkerDied(f"rank {rank} of {self.ranks} exited ({worker.exit_status()}) before {what}; the "
                                 "rank group was stopped") from None
        replies = self._gather(self.step_timeout, what)
        errors = [rank for rank, (reply, _) in enumerate(replies) if reply == b"e"]
        if errors and len(errors) < self.ranks:  # the ranks no longer run the same steps: their state is unknown
            self.kill()
            raise WorkerDied(f"rank {errors[0]} of {self.ranks} failed a call the others ran "
                             f"({replies[errors[0]][1].decode()}); the rank group was stopped")
        if errors:  # the same inputs failed on every rank alike (as they would on one)
            raise RuntimeError(f"{failure}: {replies[0][1].decode()}")
        return replies

    def execute(self, inputs) -> list[torch.Tensor]:
        replies = self._call(b"i", _encode(inputs), "running a call", "program call failed")
        outputs = _decode(replies[0][1])
        for rank, (_, payload) in enumerate(replies[1:], start=1):
            theirs = _decode(payload)
            for ours, other in zip(outputs, theirs):
                if not ours.is_floating_point() and not torch.equal(ours, other):
                    self.kill()
                    raise WorkerDied(f"rank {rank} of {self.ranks} sampled other tokens than rank 0 (the ranks did "
                                     "not run the same steps); the rank group was stopped")
        return outputs

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        self._call(b"c", pickle.dumps((int(src), int(dst), int(n))), "copying rows", "copying rows failed")

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()
        self._tmp.cleanup()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self._tmp.cleanup()
