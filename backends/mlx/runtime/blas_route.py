"""Routes MLX's CPU GEMMs to OpenBLAS (Linux): loads ``libetmlx_blas.so`` and reports whether it took.

The Linux ``mlx[cpu]`` wheel links the reference BLAS, so float32 matmuls on
the CPU run ~100x below an optimized kernel. ``libetmlx_blas.so`` (built by
``make setup`` from ``runtime/blas_route.cpp``) defines the GEMM symbols MLX
calls and forwards them to OpenBLAS; it has to be in the process's global
symbol scope before MLX binds them, which happens at MLX's first matmul. So
``import backends.mlx`` loads it, and the backend library links it as well.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasStatus", "library_path", "load", "status", "warn_if_inactive"]

_LIB_NAME = "libetmlx_blas.so"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_warned = False


@dataclass(frozen=True)
class BlasStatus:
    """Where MLX's CPU GEMMs go in this process."""

    built: bool  # libetmlx_blas.so exists (not built on macOS, or with -DETMLX_OPENBLAS=OFF)
    active: bool  # a float32 matmul on the CPU just arrived at OpenBLAS
    library: str  # OpenBLAS build description, or what MLX uses instead

    def describe(self) -> str:
        if self.active and "OpenBLAS" in self.library:
            return f"OpenBLAS via etmlx ({self.library.strip()})"
        return self.library


def library_path() -> Path:
    return Path(__file__).resolve().parent / "_lib" / _LIB_NAME


def load() -> ctypes.CDLL | None:
    """Load the route into the global symbol scope; None where it is not built."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if sys.platform == "darwin" or not path.is_file():
            return None
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise ImportError(f"cannot load {path}: {exc} (run `make setup` to rebuild it)") from exc
        lib.etmlx_blas_routed_calls.restype = ctypes.c_uint64
        lib.etmlx_blas_gemv_calls.restype = ctypes.c_uint64
        lib.etmlx_blas_one_thread_calls.restype = ctypes.c_uint64
        lib.etmlx_blas_library.restype = ctypes.c_char_p
        _lib = lib
        return lib


def routed_calls() -> int:
    """GEMM calls forwarded to OpenBLAS so far in this process (0 when not loaded)."""
    lib = load()
    return int(lib.etmlx_blas_routed_calls()) if lib is not None else 0


def gemv_calls() -> int:
    """Of routed_calls(), the one-output-column products sent to sgemv."""
    lib = load()
    return int(lib.etmlx_blas_gemv_calls()) if lib is not None else 0


def one_thread_calls() -> int:
    """Of routed_calls(), the sgemm calls small enough to run on one OpenBLAS thread (blas_route.cpp)."""
    lib = load()
    return int(lib.etmlx_blas_one_thread_calls()) if lib is not None else 0


def status() -> BlasStatus:
    """Probe with one small float32 matmul on MLX's CPU device."""
    lib = load()
    if lib is None:
        what = "Accelerate (macOS)" if sys.platform == "darwin" else "MLX's bundled BLAS (libetmlx_blas.so not built)"
        return BlasStatus(built=False, active=False, library=what)
    import mlx.core as mx

    before = routed_calls()
    a = mx.ones((4, 4), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    active = routed_calls() > before
    library = lib.etmlx_blas_library().decode() if active else "MLX's bundled reference BLAS"
    return BlasStatus(built=True, active=active, library=library)


def warn_if_inactive() -> BlasStatus:
    """Warn once if the route is built but MLX bound its GEMMs before etmlx loaded it."""
    global _warned
    st = status()
    if st.built and not st.active and not _warned:
        _warned = True
        warnings.warn(
            "MLX ran a matmul before etmlx was imported, so its CPU GEMMs stay bound to the reference "
            "BLAS bundled with mlx[cpu] (float32 matmuls ~100x slower). Import backends.mlx before "
            "using mlx.core.", RuntimeWarning, stacklevel=2)
    return st
