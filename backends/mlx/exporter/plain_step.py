"""A program's plain step: a second graph, in the same blob, that the runtime runs for a call without drafts.

A draft-verifying program (`--draft-tokens K`) pays for its acceptance arithmetic on every call, drafts or not;
on a small model, where a call costs what its instructions and graph nodes cost the host, a call without drafts
then costs ~15-25% more than the plain program's step. So the exporter traces the same module a second time in
its plain mode (DraftVerifyingHead.plain_step: the plain sampler's token, nothing accepted), lowers that, and
hands its blob to the main program's preprocess (compile specs below), which stores it in Graph.plain_step. The
runtime (loader.cpp, backend.cpp) runs it instead of the main graph when the input named here has size 1 along
axis 1 (verify [1, 1]), over the same state: the KV cache stays one.

    export_to_pte(module, args, kwargs, plain_step=PlainStep(switch=lambda on: setattr(head, "plain_step", on),
                                                             when="verify"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

import numpy as np
from executorch.exir.backend.backend_details import CompileSpec
from executorch.exir.lowered_backend_module import LoweredBackendModule

from backends.mlx.serialization.serializer import deserialize

# CompileSpec(PLAIN_STEP_SPEC, blob): the plain step's whole etmlx blob; CompileSpec(PLAIN_STEP_WHEN_SPEC,
# name): the input whose axis 1 of size 1 selects it.
PLAIN_STEP_SPEC = "etmlx.plain_step"
PLAIN_STEP_WHEN_SPEC = "etmlx.plain_step_when"


class PlainStepError(ValueError):
    """The plain step does not fit its program (an exporter bug, named)."""


@dataclass(frozen=True)
class PlainStep:
    """How to trace a module's plain step: `switch(True)` puts it in its plain mode, `switch(False)` back;
    `when`: the input (by name) whose size 1 along axis 1 means a call runs the plain step."""

    switch: Callable[[bool], None]
    when: str


def delegate_output_positions(ep) -> list[tuple[int, ...]]:
    """Per output of `ep`'s one delegate call, the positions of the program's outputs it becomes. A delegate
    returns its outputs in the order its partition makes them, so two lowerings of one signature may differ:
    the runtime matches a plain step's outputs by position, and the exporter compares these first."""
    graph = ep.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and "executorch_call_delegate" in str(n.target)]
    if len(calls) != 1:
        raise PlainStepError(f"plain step: expected one delegate call, found {len(calls)}")
    outputs = list(graph.output_node().args[0])
    width = max((user.args[1] for user in calls[0].users), default=-1) + 1
    positions = [tuple() for _ in range(width)]
    for user in calls[0].users:
        positions[user.args[1]] = tuple(i for i, out in enumerate(outputs) if out is user)
    return positions


def plain_step_specs(blob: bytes, when: str) -> list[CompileSpec]:
    return [CompileSpec(PLAIN_STEP_SPEC, blob), CompileSpec(PLAIN_STEP_WHEN_SPEC, when.encode())]


def drop_plain_step_specs(ep) -> None:
    """Removes the plain step's blob from the compile specs of `ep`'s delegates once preprocess has stored it in
    Graph.plain_step: ExecuTorch writes a delegate's compile specs into the .pte beside its blob, so it would
    otherwise be stored twice."""
    for module in ep.graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            module._compile_specs = [spec for spec in module.compile_specs if spec.key != PLAIN_STEP_SPEC]


def attach_plain_step(graph, compile_specs: List[CompileSpec]) -> None:
    """Stores the plain step the compile specs carry in `graph` (a GraphT), after checking that it takes the
    graph's inputs by name and dtype, returns its outputs' dtypes and keeps its state by name, shape and dtype."""
    specs = {spec.key: bytes(spec.value) for spec in compile_specs}
    if PLAIN_STEP_SPEC not in specs:
        return
    blob, when = specs[PLAIN_STEP_SPEC], specs.get(PLAIN_STEP_WHEN_SPEC, b"").decode()
    plain = deserialize(blob)
    names = [_name(io.name) for io in graph.inputs]
    if when not in names:
        raise PlainStepError(f"plain step: the program has no input {when!r} to select it by")
    inputs = {name: io for name, io in zip(names, graph.inputs)}
    for io in plain.inputs or []:
        name = _name(io.name)
        if name not in inputs or inputs[name].dtype != io.dtype or inputs[name].slot.kind != io.slot.kind:
            raise PlainStepError(f"plain step: its input {name!r} is not one of the program's")
    outputs = [(io.dtype, io.slot.kind) for io in graph.outputs or []]
    if [(io.dtype, io.slot.kind) for io in plain.outputs or []] != outputs:
        raise PlainStepError("plain step: its outputs differ from the program's")
    if _state(graph) != _state(plain):
        raise PlainStepError("plain step: its state differs from the program's")
    graph.plainStep = np.frombuffer(blob, dtype=np.uint8).copy()
    graph.plainStepWhen = names.index(when)


def _name(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _state(graph) -> dict:
    """Each mutable buffer's name -> (shape, dtype) of its initial value."""
    constants = graph.constants or []
    return {_name(mb.name): (tuple(constants[mb.initial].shape), constants[mb.initial].dtype)
            for mb in graph.mutableBuffers or []}
