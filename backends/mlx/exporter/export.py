"""Export an nn.Module to a .pte whose supported ops run in the etmlx delegate."""

from __future__ import annotations

import operator
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.lowered_backend_module import LoweredBackendModule
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

from backends.mlx.exporter.builder.weights import EXTERNAL_TAG, PLACEMENTS
from backends.mlx.exporter.cia_registry import remember_materialized_cia_ops
from backends.mlx.exporter.edge_target import aten_target
from backends.mlx.exporter.partitioner import MLXPartitioner
from backends.mlx.exporter.plain_step import (PlainStep, PlainStepError, delegate_output_positions,
                                              drop_plain_step_specs, plain_step_specs)
from backends.mlx.exporter import shared_constants
from backends.mlx.exporter.unused_state import drop_unused_state
from backends.mlx.exporter.preprocess import ACTIVATIONS_SPEC, FUSE_SPEC, QMM_ACTIVATIONS, RANK_SPEC, WEIGHTS_SPEC

_NOT_OPS = {"executorch_call_delegate", "getitem"}


@dataclass
class ExportResult:
    program: Any  # executorch ExecutorchProgramManager: serialized on demand, streamed by save()
    delegated_calls: int
    outside: Counter = field(default_factory=Counter)  # aten op name -> count run by ExecuTorch's CPU kernels
    reasons: dict = field(default_factory=dict)
    weights: str = "pte"  # where the delegate's constants went (export_to_pte's `weights`)
    # Mutable buffers ExecuTorch keeps (several delegate calls or a CPU op use them; partitioner.py):
    # copied into and out of the delegate each call.
    host_state: list = field(default_factory=list)
    saved: Optional[Path] = None  # where save() last wrote the .pte

    @property
    def pte(self) -> bytes:
        """The whole .pte in memory (one more copy of the weights; save() streams instead); after
        release_program(), the saved file's bytes."""
        if self.program is None:
            return self.saved.read_bytes()
        return self.program.buffer

    def release_program(self) -> None:
        """Frees ExecuTorch's program manager (the traced graphs, the lowered blob, what they hold) once the
        program is saved: the export's check loads the written file on top of what the export still holds."""
        if self.saved is None:
            raise RuntimeError("release_program() before save(): the program would be lost")
        self.program = None

    @property
    def ops_outside(self) -> int:
        return sum(self.outside.values())

    def summary(self) -> str:
        if not self.outside:
            lines = [f"{self.delegated_calls} delegate call(s); 0 ops outside the etmlx delegate"]
        else:
            lines = [f"{self.delegated_calls} delegate call(s); {self.ops_outside} op(s) outside the etmlx delegate:"]
        for name, count in self.outside.most_common():
            reason = self.reasons.get(name, "")
            lines.append(f"  {count} x {name}" + (f"  ({reason})" if reason else ""))
        if self.host_state:
            lines.append(f"  state shared by several delegate calls, kept by ExecuTorch and copied each call: "
                         f"{', '.join(self.host_state)}")
        return "\n".join(lines)

    def save(self, path) -> Path:
        """Writes FILE.pte, and FILE.ptd beside it for an export with weights="external". Both are streamed
        from ExecuTorch's serialized pieces, so no joined copy of the weights is made."""
        path = Path(path)
        if self.program is None:
            raise RuntimeError(f"the program was released after it was saved to {self.saved}")
        with open(path, "wb") as f:
            self.program.write_to_file(f)
        if self.weights == "external":
            save_external_weights(self.program, weights_path(path))
        self.saved = path
        return path


def weights_path(pte_path) -> Path:
    """FILE.ptd beside FILE.pte: where save() writes external weights and the runners look for them."""
    return Path(pte_path).with_suffix(".ptd")


def save_external_weights(program, ptd_path: Path) -> None:
    # ExecuTorch names the file after the external tag; it is written in a private folder beside the
    # destination and renamed, so concurrent exports into one folder do not collide.
    ptd_path = Path(ptd_path)
    with tempfile.TemporaryDirectory(dir=ptd_path.parent, prefix=".etmlx-ptd-") as tmp:
        program.write_tensor_data_to_file(tmp)
        written = sorted(Path(tmp).glob("*.ptd"))
        if not written:  # every constant was small enough to stay in the blob
            return
        if len(written) != 1 or written[0].name != f"{EXTERNAL_TAG}.ptd":
            raise RuntimeError(f"expected ExecuTorch to write {EXTERNAL_TAG}.ptd, got {[p.name for p in written]}")
        os.replace(written[0], ptd_path)


def count_outside(program) -> tuple[int, Counter]:
    """Delegate calls and the remaining host-side ops of a lowered ExportedProgram."""
    calls, outside = 0, Counter()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if node.target is operator.getitem:
            continue
        if "executorch_call_delegate" in name:
            calls += 1
            continue
        outside[str(aten_target(node.target))] += 1
    return calls, outside


def _lowered_plain_step(module, args, kwargs, dynamic_shapes, strict, specs, plain_step: PlainStep):
    """The plain step's compile specs (its blob) and named data: the module traced in its plain mode and lowered
    whole to the delegate, as the program will be."""
    plain_step.switch(True)
    try:
        with torch.no_grad():
            ep = torch.export.export(module, args, kwargs or {}, dynamic_shapes=dynamic_shapes, strict=strict)
    finally:
        plain_step.switch(False)
    drop_unused_state(ep)
    partitioner = MLXPartitioner(specs)
    edge = to_edge_transform_and_lower(
        ep, partitioner=[partitioner], compile_config=EdgeCompileConfig(_check_ir_validity=False)
    )
    lowered = [m for m in edge.exported_program().graph_module.modules() if isinstance(m, LoweredBackendModule)]
    _calls, outside = count_outside(edge.exported_program())
    if len(lowered) != 1 or outside or partitioner.shared_state:
        raise PlainStepError(f"the plain step did not lower to one delegate call ({len(lowered)} calls, "
                             f"{sum(outside.values())} ops outside)")
    return (plain_step_specs(lowered[0].processed_bytes, plain_step.when),
            edge._named_data_store.get_named_data_store_output(), delegate_output_positions(edge.exported_program()))


def export_to_pte(
    module: torch.nn.Module,
    args: tuple,
    kwargs: Optional[dict] = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    fuse: bool = True,
    named_data: Optional[dict[str, bytes]] = None,
    weights: str = "pte",
    plain_step: Optional[PlainStep] = None,
    qmm_activations: str = "int16",
    rank: Optional[tuple[int, int, str]] = None,
    methods: Optional[dict] = None,
) -> ExportResult:
    """`progress`, if given, is called with the name of each stage as it starts. `fuse=False` keeps
    RMSNorm / LayerNorm / rotary subgraphs as separate ops (for comparisons). `named_data` (key ->
    bytes) is stored in the .pte's named data, where runtime/pte_metadata.py and C++'s
    Program::get_named_data_map() read it back. `weights`: where the delegate's constants go: "pte"
    (ExecuTorch named data in the .pte's segments, mapped at load), "external" (a FILE.ptd beside the
    .pte, written by save()) or "inline" (inside the delegate blob, the layout before named data).
    `plain_step`: the module traced a second time in its plain mode, stored in the blob for calls without
    drafts (plain_step.py). `qmm_activations`: how the CPU kernel set rounds the activations of quantized linears,
    recorded in the program: "int16" (the default), "int8" (faster, other tokens) or "float32"
    (runtime/kernels/quantized_activations.h). `rank`: (rank, ranks, group id) of one rank's file of a
    tensor-parallel program (llm/distributed/), recorded in the blob; None: a one-rank program.
    `methods`: more methods in the same program, name -> (module, example args), traced with static shapes and
    lowered whole (a vision-language program's vision method); their ops outside the delegate are counted with the
    main method's."""
    say = progress or (lambda _stage: None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    if weights not in PLACEMENTS:
        raise ValueError(f"weights must be one of {', '.join(PLACEMENTS)}, got {weights!r}")
    if qmm_activations not in QMM_ACTIVATIONS:
        raise ValueError(f"qmm_activations must be one of {', '.join(QMM_ACTIVATIONS)}, got {qmm_activations!r}")
    module = module.eval()
    remember_materialized_cia_ops()  # a third of a small program's export time otherwise (cia_registry.py)
    say("tracing with torch.export")
    with torch.no_grad():
        ep = torch.export.export(module, args, kwargs or {}, dynamic_shapes=dynamic_shapes, strict=strict)
    drop_unused_state(ep)
    specs = [CompileSpec(WEIGHTS_SPEC, weights.encode())] + ([] if fuse else [CompileSpec(FUSE_SPEC, b"0")])
    if qmm_activations != "int16":
        specs.append(CompileSpec(ACTIVATIONS_SPEC, qmm_activations.encode()))
    if rank is not None:
        specs.append(CompileSpec(RANK_SPEC, "/".join(map(str, rank)).encode("ascii")))
    # Lowering and serializing deep-copy the program several times: its weights are shared, not cloned
    # (shared_constants.py).
    with shared_constants.shared(ep):
        return _lowered(ep, module, args, kwargs, dynamic_shapes, strict, specs, plain_step, named_data, weights,
                        say, methods)


def _lowered(ep, module, args, kwargs, dynamic_shapes, strict, specs, plain_step, named_data, weights,
             say, methods) -> ExportResult:
    plain_specs, plain_data, plain_outputs = [], None, None
    if plain_step is not None:
        say("tracing and lowering the plain step")
        plain_specs, plain_data, plain_outputs = _lowered_plain_step(module, args, kwargs, dynamic_shapes, strict,
                                                                     specs, plain_step)
    partitioner = MLXPartitioner(specs + plain_specs)
    programs, partitioners = {"forward": ep}, {"forward": [partitioner]}
    for name, (extra, extra_args) in (methods or {}).items():
        say(f"tracing the {name} method")
        with torch.no_grad():
            programs[name] = torch.export.export(extra.eval(), extra_args, strict=strict)
        drop_unused_state(programs[name])
        partitioners[name] = [MLXPartitioner(specs)]
    say("lowering to the etmlx delegate")
    edge = to_edge_transform_and_lower(
        programs if methods else ep, partitioner=partitioners if methods else [partitioner],
        compile_config=EdgeCompileConfig(_check_ir_validity=False)
    )
    # Lowering can leave more unread state behind (a rotary table whose use a fused node replaced).
    for method in edge.methods:
        drop_unused_state(edge.exported_program(method))
    calls, outside = count_outside(edge.exported_program())
    for name in methods or {}:
        extra_calls, extra_outside = count_outside(edge.exported_program(name))
        calls += extra_calls
        outside += extra_outside
    if plain_data is not None:  # weights the plain step reads that the program does not (the same keys dedupe)
        if delegate_output_positions(edge.exported_program()) != plain_outputs:
            raise PlainStepError("the plain step returns its outputs in another order than the program")
        edge._named_data_store.merge_named_data_store(plain_data)
        drop_plain_step_specs(edge.exported_program())
    for key, blob in (named_data or {}).items():
        if not isinstance(key, str) or not isinstance(blob, bytes):
            raise TypeError(f"named_data must map str keys to bytes, got {key!r}: {type(blob).__name__}")
        # The same store the delegates' preprocess fills: to_executorch writes it into the .pte's segments.
        edge._named_data_store.add_named_data(key, blob)
    say("serializing the ExecuTorch program")
    # ExecuTorch serializes only the shape of a mutable buffer it keeps unless told to store its value:
    # the state the delegate does not own starts from the module's value, as the delegate's own does.
    # (The pass matches placeholder names, "b_" + the target with "_" for ".".)
    host_state = list(partitioner.shared_state)
    init = [InitializedMutableBufferPass([t.replace(".", "_") for t in host_state])] if host_state else []
    program = edge.to_executorch(ExecutorchBackendConfig(passes=init))
    reasons = {name: why for parts in partitioners.values() for name, why in parts[0].reasons.items()}
    return ExportResult(program=program, delegated_calls=calls, outside=outside, reasons=reasons,
                        weights=weights, host_state=host_state)
