"""Loading the backend library must not put its dependencies' symbols in the process's global scope.

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
print(hasattr(lib, "etmlx_rows_new"), hasattr(ctypes.CDLL(None), "gguf_close"))
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
