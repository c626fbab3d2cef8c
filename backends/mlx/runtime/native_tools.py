"""Where the C++ programs are, and the `etmlx_decode` / `etmlx_bench` commands of an installed package.

A wheel (pyproject.toml, scikit-build-core) installs `etmlx_decode`, `etmlx_bench` and the tokenizer plugin
into `_lib/` beside `libetmlx_backend.so`; a checkout built by `make setup` has them in `build/` at the
repository root. `tool_path` looks in that order, so the same code finds them in both. The console scripts
`etmlx_decode` and `etmlx_bench` (pyproject.toml, [project.scripts]) replace the Python process with the
program, so arguments, output and exit status are the program's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TOOLS = ("etmlx_decode", "etmlx_bench", "etmlx_image_read")  # etmlx_image_read: a checkout's test program

_LIB_DIR = Path(__file__).resolve().parent / "_lib"  # an installed package: next to the backend library
_BUILD_DIR = Path(__file__).resolve().parents[3] / "build"  # a checkout: the Makefile's CMake build


def tool_path(name: str) -> Path:
    """The path of the C++ program `name` (one of TOOLS); FileNotFoundError naming both places if absent."""
    if name not in TOOLS:
        raise ValueError(f"unknown etmlx program {name!r} (one of {', '.join(TOOLS)})")
    for folder in (_LIB_DIR, _BUILD_DIR):
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"{name} not found in {_LIB_DIR} (an installed wheel) or {_BUILD_DIR} (a checkout: "
                            "run `make setup`)")


def _exec(name: str) -> int:
    try:
        path = tool_path(name)
    except FileNotFoundError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    os.execv(path, [str(path), *sys.argv[1:]])
    return 1  # not reached: execv replaces the process or raises


def etmlx_decode_main() -> int:
    return _exec("etmlx_decode")


def etmlx_bench_main() -> int:
    return _exec("etmlx_bench")
