"""Loading the backend library must not put its dependencies' symbols in the process's global scope, and the
backend library exports only the backend (the runner's policy is libetmlx_runner.so beside it).

libmlx exports the C functions of its GGUF reader (gguf_*), which share their names with llama.cpp's. With the
backend loaded RTLD_GLOBAL, a library loaded later (llama-cpp-python, `make bench-deps`) bound its own gguf_*
calls to MLX's, and `etmlx bench decode --shape` crashed inside llama.cpp's model loader."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import ctypes
from backends.mlx import runtime
lib = runtime.load()
print(hasattr(lib, "etmlx_backend_id"), hasattr(ctypes.CDLL(None), "gguf_close"))
"""


def test_the_backend_library_keeps_its_symbols_to_itself():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    reachable, leaked = out.stdout.split()
    assert reachable == "True"  # its own C functions are there through its handle
    assert leaked == "False", "libmlx's gguf_* functions are visible to every library loaded after it"


def test_the_control_global_load_does_leak_the_symbols():
    """The check above can fail: loading the same library RTLD_GLOBAL makes gguf_close visible process-wide."""
    probe = ("import ctypes\nfrom backends.mlx import runtime\nruntime._registered_backends()\n"
             "ctypes.CDLL(str(runtime.library_path()), mode=ctypes.RTLD_GLOBAL)\n"
             "print(hasattr(ctypes.CDLL(None), 'gguf_close'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "True"


def _exported(path) -> set[str]:
    """The symbols a shared library defines in its dynamic table (what dlsym and other libraries can bind to)."""
    out = subprocess.run(["nm", "-D", "--defined-only", "-C", str(path)], capture_output=True, text=True,
                         timeout=60, check=True)
    return {line.split(" ", 2)[2] for line in out.stdout.splitlines() if line.count(" ") >= 2}


# The runner's C functions (decode_rows_api.cpp) and its C++ classes (decode_rows.h, draft_sources.h).
_RUNNER_MARKS = ("etmlx_rows_", "etmlx_draft_", "etmlx_budget_", "etmlx_pacing_", "DecodeRows", "DraftBudget",
                 "DraftModelPacing", "NgramDraft", "PredictionDraft")


def test_the_backend_library_exports_only_the_backend():
    from backends.mlx import runtime

    backend, runner = _exported(runtime.library_path()), _exported(runtime.runner_library_path())
    assert "etmlx_backend_id" in backend and "etmlx_schema_version" in backend
    assert not [s for s in backend if any(mark in s for mark in _RUNNER_MARKS)], "runner symbols in the backend"
    # The control: the same marks do find the runner's functions in the runner library, which has no backend.
    assert {"etmlx_rows_new", "etmlx_draft_propose", "etmlx_budget_new", "etmlx_pacing_new"} <= runner
    assert not {s for s in runner if s.startswith("etmlx_") and not s.startswith(_RUNNER_MARKS[:4])}
    assert not [s for s in runner if "mlx::" in s or "executorch" in s]


def test_the_runner_library_loads_without_the_backend():
    """Python's decode-step rules need neither the delegate nor torch: loading the runner imports neither."""
    probe = ("import sys\nfrom backends.mlx.runtime import decode_rows_lib\n"
             "rows = decode_rows_lib.RowsCore.__init__\nlib = decode_rows_lib._lib()\n"
             "from backends.mlx import runtime\n"
             "print(runtime._lib is None, 'torch' in sys.modules, hasattr(lib, 'etmlx_backend_id'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False", "False"], out.stdout + out.stderr
