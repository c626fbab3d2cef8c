"""The Python side's environment settings: every ETMLX_* variable Python code reads is read here and nowhere
else (tests/test_options.py checks the source), and docs/options.md is their table. The C++ runtime's own
settings (ETMLX_NUM_THREADS, ETMLX_DEVICE, ETMLX_KERNELS, ...) are parsed by runtime/options.h; Python only
sets those for a child process or a block of code (`overridden`).

Each function reads the variable when called: these are read where a process starts or a library loads.
A value the table does not allow is a one-line warning and the default.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["ALLOCATOR", "BACKEND_LIB", "CACHE_DIR", "LD_PRELOAD_BEFORE", "RUNNER_LIB", "allocator", "backend_lib",
           "cache_dir", "overridden", "runner_lib", "take_ld_preload_before"]

BACKEND_LIB = "ETMLX_BACKEND_LIB"  # a path: the backend library runtime.load() loads instead of _lib's
RUNNER_LIB = "ETMLX_RUNNER_LIB"  # a path: the runner library load_runner() loads instead of _lib's
CACHE_DIR = "ETMLX_CACHE_DIR"  # a directory: where the built-in model's checkpoint is trained and kept
ALLOCATOR = "ETMLX_ALLOCATOR"  # mimalloc (default) | system: the `etmlx` command's malloc (allocator.py)
# Internal: set by the `etmlx` command for the process it re-executes with mimalloc preloaded (the caller's own
# LD_PRELOAD, restored there for the processes it starts); never set by hand.
LD_PRELOAD_BEFORE = "_ETMLX_LD_PRELOAD_BEFORE"
# Internal: set by the launcher of a tensor-parallel run (llm/distributed/launch.py) for each rank it starts: the
# directory where the rank reports its progress (rank{r}.log: "ready", then one token id per line); never set by hand.
RANK_LOG = "_ETMLX_RANK_LOG"

_ALLOCATORS = ("mimalloc", "system")


def _value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(name)
    return value or None


def backend_lib() -> Path | None:
    """$ETMLX_BACKEND_LIB, or None (the library built or installed next to the runtime package)."""
    value = _value(BACKEND_LIB)
    return Path(value) if value else None


def runner_lib() -> Path | None:
    """$ETMLX_RUNNER_LIB, or None (the runner library built or installed next to the runtime package)."""
    value = _value(RUNNER_LIB)
    return Path(value) if value else None


def rank_log() -> Path | None:
    """$_ETMLX_RANK_LOG, or None (not a rank started by etmlx's launcher)."""
    value = _value(RANK_LOG)
    return Path(value) if value else None


def cache_dir() -> Path | None:
    """$ETMLX_CACHE_DIR, or None (then $XDG_CACHE_HOME/etmlx or ~/.cache/etmlx)."""
    value = _value(CACHE_DIR)
    return Path(value) if value else None


def allocator(env: Mapping[str, str] | None = None) -> str:
    """The malloc asked for in `env` (default: this process's environment): "mimalloc" or "system"."""
    value = _value(ALLOCATOR, env)
    if value is None:
        return "mimalloc"
    if value not in _ALLOCATORS:
        warnings.warn(f"{ALLOCATOR}={value} is not one of {', '.join(_ALLOCATORS)}; using mimalloc", stacklevel=2)
        return "mimalloc"
    return value


def take_ld_preload_before() -> str | None:
    """In a process the `etmlx` command re-executed: the caller's LD_PRELOAD (removed from the environment,
    so it reaches no child); elsewhere None."""
    return os.environ.pop(LD_PRELOAD_BEFORE, None)


@contextmanager
def overridden(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: unset) for the block, then restored: for a setting the C++ runtime reads when
    a program loads (ETMLX_KERNELS) or a child process starts (ETMLX_BLAS)."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
