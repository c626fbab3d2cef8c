"""Run a .pte in the ExecuTorch runtime with the etmlx backend registered."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

from backends.mlx.runtime.load_errors import native_load

PteSource = Union[bytes, bytearray, str, Path]


def _bindings():
    from backends.mlx import runtime  # loads and registers the C++ backend

    runtime.load()
    return runtime.pybindings()


class LoadedMethod:
    """A method together with the program that owns it.

    ExecuTorch's Method points into its Program; if the Program is collected first, the
    method reads freed memory. Holding both here keeps the pair alive together, and the
    bytes of a program loaded from a buffer with them (as executorch.runtime does).
    """

    def __init__(self, program, method, data: bytes | None = None, state_ids: list[int] | None = None):
        self.program = program
        self.method = method
        self.data = data
        self.state_ids = list(state_ids or [])  # the runtime's ids of the method's stateful delegates
        self._state = None

    @property
    def state(self):
        """The method's KV cache (program_state.ProgramState); StateError when it has none."""
        from backends.mlx.runtime.program_state import ProgramState, StateError

        if self._state is None:
            if len(self.state_ids) != 1:
                raise StateError(f"the method has {len(self.state_ids)} stateful etmlx delegates, not one: "
                                 "not a decoder program")
            self._state = ProgramState(self.state_ids[0])
        return self._state

    @property
    def can_copy_rows(self) -> bool:
        """Whether copy_rows works: the method's one stateful etmlx delegate has a KV cache (a decoder program)."""
        from backends.mlx.runtime.program_state import StateError

        try:
            return bool(self.state.buffers)
        except StateError:
            return False

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of row `src`'s KV cache into row `dst` (decode_rows.py's cross-row reuse)."""
        self.state.copy(src, dst, n)

    def execute(self, inputs: Sequence) -> list:
        return list(self.method(list(inputs)))

    def input_specs(self) -> list[tuple[tuple[int, ...], int]]:
        """(sizes, ExecuTorch ScalarType code) of each input, in call order (dynamic dims at their bound)."""
        meta = self.method.method_meta()
        return [(tuple(meta.input_tensor_meta(i).sizes()), int(meta.input_tensor_meta(i).dtype()))
                for i in range(meta.num_inputs())]


def weights_beside(pte: Path) -> Path | None:
    """FILE.ptd beside FILE.pte, if there is one: where `etmlx export --external-weights` puts the weights."""
    ptd = Path(pte).with_suffix(".ptd")
    return ptd if ptd.is_file() else None


def load_method(pte: PteSource, method: str = "forward", weights: Union[str, Path, None] = None) -> LoadedMethod:
    """Load `method` of a .pte (path or bytes); the delegate's init() runs here. `weights`: the .ptd holding
    the program's external weights; by default FILE.ptd beside a FILE.pte path, if it exists. A file that does
    not load (damaged, truncated, foreign, a weight failing its checksum) raises LoadError (a ValueError) with one
    line naming the file and the reason."""
    bindings = _bindings()
    verify = bindings.Verification.InternalConsistency
    data = None
    if weights is None and isinstance(pte, (str, Path)):
        weights = weights_beside(Path(pte))
    elif weights is not None and not Path(weights).is_file():
        raise FileNotFoundError(f"weights: no such file {weights}")
    data_path = None if weights is None else str(weights)
    what = "the program" if isinstance(pte, (bytes, bytearray)) else str(pte)
    if weights is not None:
        what += f" with weights {weights}"
    if isinstance(pte, (str, Path)):
        if not Path(pte).is_file():
            raise FileNotFoundError(f"pte: no such file {pte}")
        with native_load(what):
            program = bindings._load_program(str(pte), program_verification=verify, data_path=data_path)
    elif isinstance(pte, (bytes, bytearray)):
        data = bytes(pte)
        with native_load(what):
            program = bindings._load_program_from_buffer(data, program_verification=verify, data_path=data_path)
    else:
        raise TypeError(f"pte must be a path or bytes, got {type(pte).__name__}")
    names = [program.get_method_name(i) for i in range(program.num_methods())]
    if method not in names:
        raise ValueError(f"method {method!r} not in the program (has {sorted(names)})")
    from backends.mlx.runtime import program_state

    program_state.claim()  # forget ids of loads that nobody claimed; the next claim is this load's
    with native_load(what):  # the delegate's init: where etmlx checks every weight
        loaded = program.load_method(method)
    return LoadedMethod(program, loaded, data, program_state.claim())


def run(pte: PteSource, inputs: Sequence, method: str = "forward", weights: Union[str, Path, None] = None) -> list:
    """Load and execute once; returns the outputs as a list."""
    return load_method(pte, method, weights).execute(inputs)


def as_tensors(outputs) -> list[torch.Tensor]:
    return [o if isinstance(o, torch.Tensor) else torch.tensor(o) for o in outputs]
