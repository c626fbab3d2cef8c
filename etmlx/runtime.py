"""Importing this module registers etmlx's backend with the ExecuTorch runtime of this process.

ExecuTorch finds a delegate's backend by name in its runtime's registry, and a backend registers itself when its
library loads; nothing loads etmlx's library for ExecuTorch's own Python runtime. Without this import, a .pte
that delegates to etmlx fails in `executorch.runtime` with "Failed to load method forward, error: 0x:20"
(Error::NotFound: no backend named EtmlxBackend)::

    import etmlx.runtime  # noqa: F401  (loads torch, the ExecuTorch runtime and libetmlx_backend.so)
    from executorch.runtime import Runtime

    method = Runtime.get().load_program("model.pte").load_method("forward")
    outputs = method.execute(inputs)

`load()` does the same where an import is not the place (it is safe to call again); `etmlx.load` and
`load_method` / `run` below call it themselves. `load_method(pte)` is the shortcut etmlx's own tests and docs
use: ExecuTorch's pybindings with the program's `.ptd` beside it found, inputs and outputs as torch tensors.
"""

from __future__ import annotations

from backends.mlx.runtime import BACKEND_ID, library_path, load
from backends.mlx.runtime.runner import load_method, run

__all__ = ["BACKEND_ID", "library_path", "load", "load_method", "run"]

load()
