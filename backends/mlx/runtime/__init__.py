"""Loads the etmlx C++ backend into the ExecuTorch runtime of this process.

``load()`` registers the backend ``EtmlxBackend`` with the ExecuTorch runtime of
the pybindings extension (``executorch.extension.pybindings._C``), so a .pte
delegating to etmlx can then be loaded through it (``runner.load_method`` calls
it; so must code that goes through ``executorch.runtime``, which wraps the same
extension). Importing this package loads nothing: the pybindings pull in torch
(~2 s), which the serializer, the CLI's argument checks and the blas route do
not need.

The shared library is ``_lib/libetmlx_backend.so`` next to this file (built there by
``make setup`` / CMake, or installed there by the wheel); set ``ETMLX_BACKEND_LIB`` to use another file.
It holds only the delegate. The runner's policy (decode-step rules, draft sources, budget, pacing) is
``_lib/libetmlx_runner.so`` beside it, which ``load_runner()`` loads (``ETMLX_RUNNER_LIB`` to use another
file): plain C++ without MLX or ExecuTorch, so loading it imports neither torch nor the pybindings.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

__all__ = ["BACKEND_ID", "kernels_info", "library_path", "load", "load_runner", "pybindings", "runner_library_path",
           "schema_version"]

BACKEND_ID = "EtmlxBackend"

# CMake names a shared library .dylib on macOS and .so elsewhere.
_SHARED_SUFFIX = ".dylib" if sys.platform == "darwin" else ".so"
_LIB_NAME = "libetmlx_backend" + _SHARED_SUFFIX
_RUNNER_LIB_NAME = "libetmlx_runner" + _SHARED_SUFFIX
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_runner: ctypes.CDLL | None = None


def library_path() -> Path:
    """Path of the backend shared library that load() uses."""
    from backends.mlx.runtime import options

    return options.backend_lib() or Path(__file__).resolve().parent / "_lib" / _LIB_NAME


def runner_library_path() -> Path:
    """Path of the runner library that load_runner() uses."""
    from backends.mlx.runtime import options

    return options.runner_lib() or Path(__file__).resolve().parent / "_lib" / _RUNNER_LIB_NAME


def load_runner() -> ctypes.CDLL:
    """Load the runner library once (runtime/decode_rows_lib.py types its C functions)."""
    global _runner
    with _lock:
        if _runner is None:
            path = runner_library_path()
            if not path.is_file():
                raise ImportError(f"etmlx runner library not found: {path} (a checkout: run `make setup` to build "
                                  "it; an installed package: reinstall the wheel)")
            try:
                _runner = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            except OSError as exc:
                raise ImportError(f"cannot load etmlx runner library {path}: {exc} (run `make setup` to rebuild "
                                  "it)") from exc
        return _runner


def pybindings():
    """ExecuTorch's C++ runtime extension module.

    Imported directly rather than through ``executorch.runtime``: that wrapper imports
    ``portable_lib``, which imports ``executorch.exir`` (and so torchao: ~5 s, and load-failure
    noise on stderr) only to issue a warning. The extension links libtorch_python, so torch's
    libraries must be in the process first."""
    import torch  # noqa: F401

    from executorch.extension.pybindings import _C

    return _C


def _registered_backends() -> list[str]:
    return list(pybindings()._get_registered_backend_names())


def load() -> ctypes.CDLL:
    """Load the backend library once and check that it registered itself.

    Safe to call repeatedly; later calls return the already loaded library.
    """
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        # Load the ExecuTorch pybindings first, so libexecutorch.so (and its
        # backend registry) is already in the process; the backend library
        # then binds to that same copy.
        _registered_backends()
        path = library_path()
        if not path.is_file():
            from backends.mlx.runtime import options

            hint = (
                "ETMLX_BACKEND_LIB points at a missing file"
                if options.backend_lib() is not None
                else "a checkout: run `make setup` to build it; an installed package: reinstall the wheel"
            )
            raise ImportError(f"etmlx backend library not found: {path} ({hint})")
        # Local symbol scope: with RTLD_GLOBAL, its dependencies' symbols (libmlx's GGUF reader exports
        # gguf_* functions) would take over those of libraries loaded later, and llama.cpp's GGUF loader
        # crashed inside MLX's gguf_find_key (tests/test_runtime_symbols.py).
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise ImportError(f"cannot load etmlx backend library {path}: {exc} "
                              "(run `make setup` to rebuild it)") from exc
        lib.etmlx_backend_id.restype = ctypes.c_char_p
        lib.etmlx_schema_version.restype = ctypes.c_uint32
        lib_id = lib.etmlx_backend_id().decode()
        if lib_id != BACKEND_ID:
            raise RuntimeError(f"{path} registers backend {lib_id!r}, expected {BACKEND_ID!r}")
        names = _registered_backends()
        if BACKEND_ID not in names:
            raise RuntimeError(
                f"loaded {path} but {BACKEND_ID} is not among the ExecuTorch runtime's "
                f"registered backends {names}; the library is probably linked against a "
                "different libexecutorch.so than the executorch Python package uses "
                "(run `make setup` to rebuild it)")
        _lib = lib
    from backends.mlx.runtime import blas_route

    blas_route.warn_if_inactive()
    return lib


def schema_version() -> int:
    """Blob schema version the loaded C++ runtime accepts."""
    return int(load().etmlx_schema_version())


def kernels_info() -> dict:
    """The cpu kernel set's quantized-matmul variant ("avx512", "avx2", "neon" or "scalar"; ETMLX_QMM_ISA
    forces one), its thread pool's size (the CPUs this process may use, or ETMLX_NUM_THREADS) and the
    precision its few-row loop gives the activations of a 4-bit group-64 linear in a program exported with the
    default int16 activations ("int16", or "float32" where the variant has no integer loop; a program exported
    with int8 runs int8 wherever this says int16: kernels/quantized_activations.h), and the precision its
    many-row product (prefill) gives them ("gemm_activations": integer with AVX-512 VNNI, and on
    AVX2 for 4-bit weights)."""
    lib = load()
    lib.etmlx_quantized_rows_isa.restype = ctypes.c_char_p
    lib.etmlx_quantized_activations.restype = ctypes.c_char_p
    lib.etmlx_quantized_gemm_activations.restype = ctypes.c_char_p
    lib.etmlx_cpu_threads.restype = ctypes.c_int
    return {"isa": lib.etmlx_quantized_rows_isa().decode(), "threads": int(lib.etmlx_cpu_threads()),
            "activations": lib.etmlx_quantized_activations().decode(),
            "gemm_activations": lib.etmlx_quantized_gemm_activations().decode()}


def fused_node_counts() -> dict:
    """How many nodes of each fused kind the cpu kernel set has built in this process (runtime/linear_groups.h;
    ETMLX_FUSE_LINEARS=0 at load turns them off): "linear_groups" (several quantized linears over one input),
    "silu_epilogues" (of those, the ones that also made a gated MLP's SiLU product), "add_rms_norms" (a residual
    add and its RMSNorm), "matmul_add_rms_norms" (an output projection with the add and norm after it), "rope_pairs" (a layer's q and k
    rotated by one node)."""
    lib = load()
    names = {"linear_groups": "etmlx_grouped_linear_nodes", "silu_epilogues": "etmlx_silu_epilogues",
             "add_rms_norms": "etmlx_add_rms_norm_nodes", "matmul_add_rms_norms": "etmlx_matmul_add_rms_norm_nodes",
             "rope_pairs": "etmlx_rope_pair_nodes"}
    counts = {}
    for key, symbol in names.items():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_longlong
        counts[key] = int(fn())
    return counts
