"""A program's weights shared, not copied, by the deep copies ExecuTorch's lowering makes.

`to_backend` deep-copies the partitioned program before it calls a backend's preprocess
(executorch/exir/backend/backend_api.py: `copied_edge_program = copy.deepcopy(edge_program)`), and so do other
steps of to_edge and to_executorch. A tensor's deep copy is a clone: at real size each of them was one more time
the weights in memory (5 GB at 8B, measured), and the named data then read the clone. Inside `shared(ep)` the
deep copy of each of the program's constants is that tensor itself. Constants are never written during an
export: the mutable buffers (the KV cache, the sampler's state), which the program writes, are copied as before.
"""

from __future__ import annotations

import contextlib

import torch


def _identity(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def constant_identities(ep) -> set:
    """The (address, shape, strides, dtype) of every constant `ep` holds, its mutable buffers left out."""
    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    found = set()
    for name, tensor in [*ep.state_dict.items(), *ep.constants.items()]:
        if name in mutated or not isinstance(tensor, torch.Tensor) or type(tensor) not in (torch.Tensor,
                                                                                             torch.nn.Parameter):
            continue  # a FakeTensor or another subclass keeps its own deep copy
        if tensor.device.type == "cpu" and tensor.numel():
            found.add(_identity(tensor))
    return found


@contextlib.contextmanager
def shared(ep):
    """Deep copies of `ep`'s constants (by address, shape, strides and dtype) are the constants themselves."""
    identities = constant_identities(ep)
    tensor_copy, parameter_copy = torch.Tensor.__deepcopy__, torch.nn.Parameter.__deepcopy__

    def tensor_deepcopy(self, memo):
        if type(self) is torch.Tensor and self.device.type == "cpu" and _identity(self) in identities:
            return self
        return tensor_copy(self, memo)

    def parameter_deepcopy(self, memo):
        if type(self) is torch.nn.Parameter and self.device.type == "cpu" and _identity(self) in identities:
            return self
        return parameter_copy(self, memo)

    torch.Tensor.__deepcopy__, torch.nn.Parameter.__deepcopy__ = tensor_deepcopy, parameter_deepcopy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__, torch.nn.Parameter.__deepcopy__ = tensor_copy, parameter_copy
