"""Keeps one program worker up: the engine's `program`, restarting the worker when it dies. For an N-rank
program the "worker" is the rank group (serve/rank_group.py): any rank lost stops and restarts all of them.

A worker that exits or misses its step deadline raises WorkerDied out of `execute` (the engine
fails the rows of that call: their caches lived in the worker). `recover()` then starts a new
worker, up to `attempts` tries in a row with a growing pause; when all fail it raises
SupervisorGaveUp and the server exits non-zero. While no worker is up, `up` is False and /health
answers 503.
"""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backends.mlx.llm.distributed.hosts import DEFAULT_SSH, RankHost
from backends.mlx.serve.program_worker import ProgramWorker

if TYPE_CHECKING:
    from backends.mlx.serve.rank_group import RankGroup

log = logging.getLogger("etmlx.serve")


class SupervisorGaveUp(RuntimeError):
    """No worker could be started after the allowed attempts."""


class SupervisedProgram:
    def __init__(self, start: Callable[[], "ProgramWorker | RankGroup"], attempts: int = 3, pause: float = 0.5):
        self._start = start
        self.attempts = attempts
        self.pause = pause
        self.restarts = 0  # read by /health
        self.worker: ProgramWorker | None = start()

    @classmethod
    def for_pte(cls, pte: Path, step_timeout: float | None = None, attempts: int = 3, ranks: int = 1,
                hosts: list[RankHost] | None = None, ssh: str = DEFAULT_SSH,
                rank_timeout: float | None = None) -> "SupervisedProgram":
        """ranks > 1: an N-rank program, one worker per rank (serve/rank_group.py) started where `hosts` say
        (another machine's through `ssh`; default: here, on free loopback ports); a call waits at most
        min(step_timeout, rank_timeout) s."""
        if ranks == 1:
            return cls(lambda: ProgramWorker(pte, step_timeout=step_timeout), attempts=attempts)
        from backends.mlx.serve.rank_group import RankGroup

        deadline = min((t for t in (step_timeout, rank_timeout) if t is not None), default=None)
        return cls(lambda: RankGroup(pte, ranks, step_timeout=deadline, hosts=hosts, ssh=shlex.split(ssh)),
                   attempts=attempts)

    @property
    def up(self) -> bool:
        return self.worker is not None and self.worker.alive()

    def execute(self, inputs):
        if self.worker is None:
            raise RuntimeError("no program worker is running")
        return self.worker.execute(inputs)  # WorkerDied: the worker is already killed

    @property
    def can_copy_rows(self) -> bool:
        return self.worker is not None and self.worker.can_copy_rows

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        if self.worker is None:
            raise RuntimeError("no program worker is running")
        self.worker.copy_rows(src, dst, n)

    def recover(self) -> None:
        """Start a new worker if the current one is gone; SupervisorGaveUp when none would start."""
        if self.up:
            return
        if self.worker is not None:
            self.worker.kill()
            self.worker = None
        for attempt in range(1, self.attempts + 1):
            try:
                self.worker = self._start()
                self.restarts += 1
                log.warning("program worker restarted (pid %d, attempt %d)", self.worker.pid, attempt)
                return
            except Exception as exc:  # noqa: BLE001 - any start failure counts as an attempt
                log.error("program worker restart %d/%d failed: %s", attempt, self.attempts, exc)
                time.sleep(self.pause * attempt)
        raise SupervisorGaveUp(f"the program worker could not be restarted ({self.attempts} attempts)")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
