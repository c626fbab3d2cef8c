"""Artifacts built once per test run, whatever the number of pytest-xdist workers.

Each xdist worker has its own tmp_path_factory base directory, so a session fixture that builds into it
builds once per worker (a trained model, an exported program: tens of seconds each). `shared_dir` is one
directory for the whole run (the workers' common parent), and `exclusive` the file lock under which one
worker builds while the others wait and then reuse what it built."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def shared_dir(tmp_path_factory, name: str) -> Path:
    """`name` under a directory every worker of this run sees (this run's base directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist the base is .../pytest-N/popen-gwK; .../pytest-N is this run's, shared by its workers.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "shared" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive(directory: Path):
    """Hold `directory`'s lock: one process at a time between build-if-missing and its last write."""
    with open(Path(directory) / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
