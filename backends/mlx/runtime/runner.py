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


class LoadedMethod:
    """A method together with the program that owns it.

    ExecuTorch's Method points into its Program; if the Program is collected first, the
    method reads freed memory. Holding both here keeps the pair alive together.
    """

    def __init__(self, program, method):
        self.program = program
        self.method = method

    def execute(self, inputs: Sequence) -> list:
        return list(self.method.execute(list(inputs)))

    def input_specs(self) -> list[tuple[tuple[int, ...], int]]:
        """(sizes, ExecuTorch ScalarType code) of each input, in call order (dynamic dims at their bound)."""
        meta = self.method.metadata
        return [(tuple(meta.input_tensor_meta(i).sizes()), int(meta.input_tensor_meta(i).dtype()))
                for i in range(meta.num_inputs())]


def load_method(pte: PteSource, method: str = "forward") -> LoadedMethod:
    """Load `method` of a .pte (path or bytes); the delegate's init() runs here."""
    if isinstance(pte, (str, Path)) and not Path(pte).is_file():
        raise FileNotFoundError(f"pte: no such file {pte}")
    program = _runtime().load_program(pte)
    loaded = program.load_method(method)
    if loaded is None:
        raise ValueError(f"method {method!r} not in the program (has {sorted(program.method_names)})")
    return LoadedMethod(program, loaded)


def run(pte: PteSource, inputs: Sequence, method: str = "forward") -> list:
    """Load and execute once; returns the outputs as a list."""
    return load_method(pte, method).execute(inputs)


def as_tensors(outputs) -> list[torch.Tensor]:
    return [o if isinstance(o, torch.Tensor) else torch.tensor(o) for o in outputs]
