"""Drop the exported program's parameters, buffers and tensor constants that no node reads.

torch.export keeps a placeholder for every parameter and buffer of the module, read or not, and
ExecuTorch stores each kept placeholder's value in the .pte's constant buffer. A tied, quantized
embedding is the common case: the head and the embedding share one set of packed weights, scales
and biases, the graph reads them under one name, and the other name's placeholders have no user;
without this pass the file holds that set twice (68 + 8.5 + 8.5 MB at Qwen2.5-0.5B). ExecuTorch's
own remove_unused_parameters_pass drops only parameters, and quantized tensors are buffers.
Mutated buffers stay: writing them back is a use."""

from __future__ import annotations

from torch.export.exported_program import ExportedProgram, InputKind

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def drop_unused_state(ep: ExportedProgram) -> list[str]:
    """Remove unread state from `ep` in place; return the targets removed."""
    sig = ep.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    unused = [spec for spec in sig.input_specs
              if spec.kind in _STATE_KINDS and spec.target not in mutated
              and not placeholders[spec.arg.name].users]
    if not unused:
        return []
    for spec in unused:
        sig.input_specs.remove(spec)
        ep.graph.erase_node(placeholders[spec.arg.name])
        # An aliased tensor may still be live under another name: drop only names nothing else lists.
        if not any(s.target == spec.target for s in sig.input_specs):
            if spec.kind == InputKind.CONSTANT_TENSOR:
                ep.constants.pop(spec.target, None)
            else:
                ep.state_dict.pop(spec.target, None)
    ep.graph_module.recompile()
    return [spec.target for spec in unused]
