"""The `etmlx` command's malloc: mimalloc (the cmeel-mimalloc wheel) in place of glibc's, on Linux.

MLX allocates and frees every graph node's buffers and bookkeeping on two threads (the caller builds the
graph, MLX's stream thread releases it), and glibc's malloc serialises that on its arena lock: malloc, free
and their lock waits were ~12% of a 0.5B decode step's CPU time (`perf`). With mimalloc the same step is
~7% faster through the Python loop and through etmlx_bench (docs/log.md, "mimalloc"), with the same tokens.

A library cannot swap the malloc of a process that is already running, so the `etmlx` command re-executes
itself once, before any work, with mimalloc preloaded (LD_PRELOAD): what vLLM's CPU backend and Intel's
PyTorch extension ask their users to do by hand. The server's program worker, the process that runs its decode
steps, starts with it too (`env_with_mimalloc`). The C++ tools link mimalloc in instead (CMakeLists.txt).
`ETMLX_ALLOCATOR=system` keeps glibc's malloc. A program that imports etmlx as a library keeps the malloc its
process started with; `LD_PRELOAD=$(python -c 'from backends.mlx.runtime import allocator;
print(allocator.mimalloc_library())')` gives it mimalloc.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from backends.mlx.runtime import options

__all__ = ["CHOICE_ENV", "active", "env_with_mimalloc", "give_back_freed", "mimalloc_library", "reexec_with_mimalloc"]

CHOICE_ENV = options.ALLOCATOR  # "system": keep glibc's malloc


def mimalloc_library() -> Path | None:
    """The cmeel-mimalloc wheel's shared library, or None where it is not installed (or not Linux)."""
    if sys.platform != "linux":
        return None
    from importlib.metadata import PackageNotFoundError, files

    try:
        listed = files("cmeel-mimalloc") or []
    except PackageNotFoundError:
        return None
    # libmimalloc.so.3, the soname: the name a loader asks for (libmimalloc.so is a development link).
    candidates = sorted((f for f in listed if f.name.startswith("libmimalloc.so.") and f.name.count(".") == 2),
                        key=lambda f: f.name)
    for f in candidates:
        path = Path(f.locate()).resolve()
        if path.is_file():
            return path
    return None


def active() -> str:
    """"mimalloc X.Y.Z" where this process's malloc is mimalloc's (a live block lies in its heap), else
    "system"."""
    process = ctypes.CDLL(None)
    if not hasattr(process, "mi_version") or not hasattr(process, "mi_is_in_heap_region"):
        return "system"
    process.calloc.restype = ctypes.c_void_p
    process.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    process.free.argtypes = [ctypes.c_void_p]
    process.mi_is_in_heap_region.restype = ctypes.c_bool
    process.mi_is_in_heap_region.argtypes = [ctypes.c_void_p]
    block = process.calloc(1, 64)
    try:
        if not process.mi_is_in_heap_region(block):
            return "system"
    finally:
        process.free(block)
    v = process.mi_version()  # MI_MALLOC_VERSION: major, then two digits of minor and two of patch
    return f"mimalloc {v // 10000}.{v // 100 % 100}.{v % 100}"


def give_back_freed() -> None:
    """Returns the memory this process's malloc holds freed to the OS (mimalloc: `mi_collect(true)`; glibc:
    `malloc_trim(0)`), before a step that needs much more: a malloc otherwise keeps freed pages for reuse."""
    if sys.platform != "linux":
        return
    process = ctypes.CDLL(None)
    if active() != "system":
        process.mi_collect.argtypes = [ctypes.c_bool]
        process.mi_collect(True)
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim.argtypes = [ctypes.c_size_t]
        process.malloc_trim(0)


def env_with_mimalloc(env: dict | None = None) -> dict:
    """A copy of `env` (default: this process's) under which a Python child starts with mimalloc preloaded: for
    the server's program worker, which runs the decode steps. Unchanged where it does not apply
    (ETMLX_ALLOCATOR=system, not Linux, the wheel missing, or already preloaded)."""
    env = dict(os.environ if env is None else env)
    library = mimalloc_library()
    if options.allocator(env) == "system" or library is None:
        return env
    before = env.get("LD_PRELOAD", "")
    if str(library) in before.split():
        return env
    env["LD_PRELOAD"] = f"{library} {before}".strip()
    # mimalloc asks for transparent huge pages on its arenas; a weight loaded there then counts 2 MB pages (peak
    # RSS +14% at 0.5B for ~4% of decode speed; glibc used 4 KB pages). MIMALLOC_ALLOW_THP=1 keeps them.
    env.setdefault("MIMALLOC_ALLOW_THP", "0")
    return env


def reexec_with_mimalloc() -> None:
    """Replace this process by itself with mimalloc preloaded, once; returns where it does not apply
    (ETMLX_ALLOCATOR=system, not Linux, the wheel missing, or already done). In the re-executed process it
    restores the caller's LD_PRELOAD for the processes this one starts."""
    # In the re-executed process mimalloc is loaded; the processes it starts (C++ tools with their own mimalloc,
    # Python children) get the caller's LD_PRELOAD.
    if (before := options.take_ld_preload_before()) is not None:
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    env = env_with_mimalloc()
    if env.get("LD_PRELOAD", "") == os.environ.get("LD_PRELOAD", "") or active() != "system":
        return  # nothing to add, or this process already runs it
    env[options.LD_PRELOAD_BEFORE] = os.environ.get("LD_PRELOAD", "")
    # sys.orig_argv: the interpreter's own command line (its options, -m or a script, the arguments).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
