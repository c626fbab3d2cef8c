"""Walks a (delegated) edge program and emits an etmlx Graph.

Slots: every tensor the graph touches gets a tensor slot (Tid); symbolic ints
get value slots (Vid). Constants (parameters, buffers, lifted constants) are
embedded in the graph when small and go to ExecuTorch named data otherwise
(builder/weights.py); user inputs and outputs keep the program's order, which
is the order ExecuTorch passes them to the backend.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np
import torch
from torch.export import ExportedProgram

from backends.mlx.exporter import dtypes as D
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.builder.weights import WeightStore
from backends.mlx.exporter.edge_target import aten_target
from backends.mlx.exporter.fusion.plan import FusionPlan, plan_fusions
from backends.mlx.serialization import fb_classes as fbc
from backends.mlx.serialization.generated.fb.SlotKind import SlotKind
from backends.mlx.serialization.generated.node_table import NODE_FIELDS, NODE_TAGS


class BuildError(RuntimeError):
    """A handler or the builder met something it claimed to support; a bug."""


class ValueSlot(int):
    """A value-slot index (symbolic int), distinct from a plain tensor slot."""


class ProgramBuilder:
    def __init__(self, ep: ExportedProgram, fuse: bool = True, weights: WeightStore | None = None):
        self.ep = ep
        # Where constants' bytes go (inline or ExecuTorch named data); see builder/weights.py.
        self.weights = weights if weights is not None else WeightStore("inline")
        # Subgraphs emitted as one fused node (RMSNorm, rotary embedding); see backends/mlx/exporter/fusion.
        self.fuse = fuse
        self.fusions = plan_fusions(ep) if fuse else FusionPlan()
        self.num_tensors = 0
        self.num_values = 0
        self.instructions: list = []
        self.constants: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.mutable_buffers: list = []
        self.buffer_slots: dict[str, int] = {}  # buffer target name -> its mutable tensor slot
        self.env: dict[torch.fx.Node, Any] = {}
        self.symbol_sources: dict[Any, tuple[int, int]] = {}  # sympy symbol -> (input tensor slot, axis)
        self.symbol_values: dict[Any, ValueSlot] = {}

    # ---- slots -----------------------------------------------------------
    def new_tensor(self) -> int:
        self.num_tensors += 1
        return self.num_tensors - 1

    def new_value(self) -> ValueSlot:
        self.num_values += 1
        return ValueSlot(self.num_values - 1)

    def tid(self, arg) -> int:
        """Tensor slot holding an fx-node argument."""
        if not isinstance(arg, torch.fx.Node):
            raise BuildError(f"expected a tensor argument, got {arg!r}")
        slot = self.env.get(arg)
        if slot is None or isinstance(slot, (tuple, ValueSlot)):
            raise BuildError(f"{arg.name} has no tensor slot")
        return slot

    def int_or_vid(self, arg) -> tuple:
        """('lit', n) for a known int, ('vid', v) for a symbolic one."""
        if isinstance(arg, torch.fx.Node):
            slot = self.env.get(arg)
            if not isinstance(slot, ValueSlot):
                raise BuildError(f"{arg.name} is not a symbolic int")
            return ("vid", int(slot))
        if isinstance(arg, torch.SymInt):
            hint = arg.node.maybe_as_int()
            if hint is not None:
                return ("lit", hint)
            return ("vid", int(self.symbol_value(arg)))
        return ("lit", int(arg))

    def symbol_value(self, sym: torch.SymInt) -> ValueSlot:
        """A value slot holding a symbolic input size, read from the input that carries it."""
        expr = sym.node.expr
        if expr in self.symbol_values:
            return self.symbol_values[expr]
        source = self.symbol_sources.get(expr)
        if source is None:
            raise BuildError(f"symbolic size {expr} is not a dimension of any input")
        out = self.new_value()
        self.emit("SymSizeNode", x=source[0], axis=source[1], out=out)
        self.symbol_values[expr] = out
        return out

    @staticmethod
    def meta(node: torch.fx.Node):
        return node.meta["val"]

    # ---- emission --------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        spec = NODE_FIELDS.get(kind)
        if spec is None:
            raise BuildError(f"unknown node kind {kind}")
        unknown = set(fields) - set(spec)
        if unknown:
            raise BuildError(f"{kind} has no field(s) {sorted(unknown)}")
        obj = fbc.node_class(kind)()
        for name, value in fields.items():
            head, *rest = name.split("_")  # the object API spells fields in camelCase
            setattr(obj, head + "".join(w.title() for w in rest), _convert(spec[name], value))
        instr = fbc.InstructionT()
        instr.nodeType = NODE_TAGS[kind]
        instr.node = obj
        self.instructions.append(instr)

    def op(self, kind: str, **fields) -> int:
        """Emit a node whose output is a fresh tensor slot; return that slot."""
        out = self.new_tensor()
        self.emit(kind, out=out, **fields)
        return out

    def full(self, value, dtype: torch.dtype, shape: Sequence = ()) -> int:
        return self.op("FullNode", shape=list(shape), value=float(value), dtype=D.to_schema(dtype))

    def cast(self, tid: int, src: torch.dtype, dst: torch.dtype) -> int:
        if src == dst:
            return tid
        return self.op("AsTypeNode", x=tid, dtype=D.to_schema(dst))

    def operand(self, arg, dtype: torch.dtype) -> int:
        """A tensor argument cast to `dtype`, or a Python scalar as a 0-d tensor."""
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.tid(arg), self.meta(arg).dtype, dtype)
        if isinstance(arg, (bool, int, float)):
            return self.full(arg, dtype)
        raise BuildError(f"unsupported operand {arg!r}")

    def add_constant(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().contiguous().cpu()
        slot = self.new_tensor()
        c = fbc.ConstantT()
        c.slot = _tid(slot)
        c.dtype = D.to_schema(tensor.dtype)
        c.shape = list(tensor.shape)
        # All-zero tensors (a KV cache's start) are allocated at load: the file does not grow with them.
        c.zeros = bool(tensor.numel()) and not bool(tensor.reshape(-1).view(torch.uint8).any())
        c.key = None if c.zeros or not tensor.numel() else self.weights.key_for(tensor)
        if tensor.numel() and not c.zeros and c.key is None:
            c.data = tensor.reshape(-1).view(torch.uint8).numpy().copy()
        else:
            c.data = np.zeros(0, np.uint8)
        self.constants.append(c)
        return slot

    # ---- graph walk ------------------------------------------------------
    def build(self):
        sig = self.ep.graph_signature
        const_names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                       **sig.inputs_to_lifted_tensor_constants}
        mutated = set(sig.buffers_to_mutate.values())
        user_inputs = set(sig.user_inputs)
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                if node.name in sig.inputs_to_buffers and sig.inputs_to_buffers[node.name] in mutated:
                    self.env[node] = self._add_mutable_buffer(sig.inputs_to_buffers[node.name])
                elif node.name in const_names:
                    self.env[node] = self.add_constant(self._constant_value(const_names[node.name]))
                elif node.name in user_inputs:
                    self._add_input(node)
                else:
                    raise BuildError(f"placeholder {node.name} is neither a constant nor a user input")
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                user_outputs = set(sig.user_outputs)
                for out in node.args[0]:
                    name = getattr(out, "name", None)
                    if name in sig.buffers_to_mutate:
                        # The delegate owns the state: write the new value into the buffer's slot.
                        self.emit("CopyNode", x=self.tid(out), out=self.buffer_slots[sig.buffers_to_mutate[name]])
                    elif name in user_outputs or name is None:
                        self._add_output(out)
                    else:
                        raise BuildError(f"output {name} is neither a user output nor a buffer mutation")
            elif node.op != "get_attr":
                raise BuildError(f"unsupported fx node kind {node.op}")
        graph = fbc.GraphT()
        graph.numTensors = self.num_tensors
        graph.numValues = self.num_values
        graph.constants = self.constants
        graph.inputs = self.inputs
        graph.outputs = self.outputs
        graph.mutableBuffers = self.mutable_buffers
        graph.instructions = self.instructions
        return graph

    def _add_mutable_buffer(self, name: str) -> int:
        """State the delegate keeps across calls, starting from the buffer's exported value."""
        initial = len(self.constants)
        # A copy: the store reads a constant's bytes in place until the file is written (weights.TensorBytes),
        # and an eager call of the module before that would write new state into the buffer itself.
        self.add_constant(self._constant_value(name).clone())
        slot = self.new_tensor()
        mb = fbc.MutableBufferT()
        mb.slot = _tid(slot)
        mb.initial = initial
        mb.name = name
        self.mutable_buffers.append(mb)
        self.buffer_slots[name] = slot
        return slot

    def _constant_value(self, name: str) -> torch.Tensor:
        if name in self.ep.state_dict:
            return self.ep.state_dict[name]
        if name in self.ep.constants:
            return self.ep.constants[name]
        raise BuildError(f"constant {name} not found in the program")

    def _add_input(self, node):
        val = self.meta(node)
        if isinstance(val, torch.Tensor):
            slot = self.new_tensor()
            self.inputs.append(_io(SlotKind.Tensor, slot, D.to_schema(val.dtype), node.name))
            for axis, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
                    self.symbol_sources.setdefault(size.node.expr, (slot, axis))
        elif isinstance(val, (int, torch.SymInt)):
            slot = self.new_value()
            self.inputs.append(_io(SlotKind.Value, slot, D.to_schema(torch.int64), node.name))
        else:
            raise BuildError(f"input {node.name} of type {type(val).__name__} is not supported")
        self.env[node] = slot

    def _add_output(self, out):
        if not isinstance(out, torch.fx.Node):
            raise BuildError(f"output {out!r} is not a graph value")
        slot = self.env[out]
        if isinstance(slot, ValueSlot):
            self.outputs.append(_io(SlotKind.Value, slot, D.to_schema(torch.int64)))
        else:
            self.outputs.append(_io(SlotKind.Tensor, slot, D.to_schema(self.meta(out).dtype)))

    def _call(self, node):
        if node.target is operator.getitem:
            source, index = node.args
            self.env[node] = self.env[source][index]
            return
        if node in self.fusions.absorbed:
            return  # only a fused node used this value; that node computes it internally
        fusion = self.fusions.by_root.get(node)
        if fusion is not None:
            try:
                self.env[node] = fusion.emit(self)
            except BuildError:
                raise
            except Exception as exc:  # a matcher bug: surface it with the node it claimed
                raise BuildError(f"fused {fusion.kind} failed at {node.name}: {exc}") from exc
            return
        entry = REGISTRY.lookup(node.target)
        if entry is None:
            raise BuildError(f"no handler for {aten_target(node.target)} ({node.name})")
        reason = entry.supports(node)
        if reason is not None:
            raise BuildError(f"{node.name}: {reason}")
        try:
            result = entry.handler(self, node)
        except BuildError:
            raise
        except Exception as exc:  # a handler bug: surface it with the node that triggered it
            raise BuildError(f"handler for {aten_target(node.target)} failed on {node.name}: {exc}") from exc
        self.env[node] = result


def _tid(i: int):
    t = fbc.TidT()
    t.idx = int(i)
    return t


def _vid(i: int):
    v = fbc.VidT()
    v.idx = int(i)
    return v


def _int_or_vid(value):
    iv = fbc.IntOrVidT()
    if isinstance(value, tuple):
        kind, n = value
        if kind == "vid":
            iv.vid = int(n)
            return iv
        value = n
    iv.literal = int(value)
    iv.vid = -1
    return iv


def _io(kind, slot, dtype, name=None):
    io = fbc.IoSpecT()
    io.name = name
    s = fbc.SlotT()
    s.kind = kind
    s.idx = int(slot)
    io.slot = s
    io.dtype = dtype
    return io


def _convert(schema_type: str, value):
    if schema_type == "Tid":
        return _tid(value)
    if schema_type == "Vid":
        return _vid(value)
    if schema_type == "[Tid]":
        return [_tid(v) for v in value]
    if schema_type == "IntOrVid":
        return _int_or_vid(value)
    if schema_type == "[IntOrVid]":
        return [_int_or_vid(v) for v in value]
    if schema_type == "[int]":
        return [int(v) for v in value]
    return value
