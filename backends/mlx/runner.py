"""Run a .pte in the ExecuTorch runtime with the etmlx backend registered."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

PteSource = Union[bytes, bytearray, str, Path]


def _runtime():
    import backends.mlx.runtime  # noqa: F401  (loads and registers the C++ backend)
    from executorch.runtime import Runtime

    return Runtime.get()


def load_method(pte: PteSource, method: str = "forward"):
    """Load `method` of a .pte (path or bytes); the delegate's init() runs here."""
    if isinstance(pte, (str, Path)) and not Path(pte).is_file():
        raise FileNotFoundError(f"pte: no such file {pte}")
    program = _runtime().load_program(pte)
    loaded = program.load_method(method)
    if loaded is None:
        raise ValueError(f"method {method!r} not in the program (has {sorted(program.method_names)})")
    return loaded


def run(pte: PteSource, inputs: Sequence, method: str = "forward") -> list:
    """Load and execute once; returns the outputs as a list."""
    return list(load_method(pte, method).execute(list(inputs)))


def as_tensors(outputs) -> list[torch.Tensor]:
    return [o if isinstance(o, torch.Tensor) else torch.tensor(o) for o in outputs]
