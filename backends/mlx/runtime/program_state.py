"""The host's access to a loaded program's KV cache (program_state.cpp, through ctypes).

A decoder program's KV cache is the delegate's mutable state: one buffer per layer's keys and values,
[rows, kv_heads, slots, head_dim] (llm/decoder/kv_cache.py; with --kv-bits, the packed bytes, scales and biases
each such a buffer, their last size not the head's). `ProgramState` reads a row's first n
positions of every buffer into host tensors, writes them back, and copies them from one row to another
inside the state. runner.load_method finds the state of the method it loads (`LoadedMethod.state`).

Slots are positions only while a row never wrapped a sliding-window ring (runtime/decode_rows.h): callers
refuse ring programs (DecoderMeta.ring_cache).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# uint8: the packed keys and values of a --kv-bits program (llm/decoder/kv_quant.py)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
_MAX_CLAIM = 64


class StateError(ValueError):
    """A state access the runtime refused (one line: a bad row, n beyond the cache, not a decoder program, ...)."""


def _lib() -> ctypes.CDLL:
    from backends.mlx import runtime

    lib = runtime.load()
    if not hasattr(lib, "etmlx_state_claim"):
        raise StateError(f"{runtime.library_path()} has no state access: rebuild it (`make setup`)")
    if getattr(lib, "_etmlx_state_typed", False):
        return lib
    u64, i64 = ctypes.c_uint64, ctypes.c_int64
    lib.etmlx_state_error.restype = ctypes.c_char_p
    lib.etmlx_state_claim.argtypes = [ctypes.POINTER(u64), ctypes.c_int]
    lib.etmlx_state_kv_buffers.argtypes = [u64]
    lib.etmlx_state_kv_info.argtypes = [u64, ctypes.c_int, ctypes.POINTER(i64), ctypes.POINTER(ctypes.c_char_p)]
    lib.etmlx_state_read.argtypes = [u64, i64, i64, ctypes.c_void_p, u64]
    lib.etmlx_state_write.argtypes = [u64, i64, i64, ctypes.c_void_p, u64]
    lib.etmlx_state_copy.argtypes = [u64, i64, i64, i64]
    lib._etmlx_state_typed = True
    return lib


def _check(lib, rc: int) -> int:
    if rc < 0:
        raise StateError(lib.etmlx_state_error().decode())
    return rc


def claim() -> list[int]:
    """The state ids of the stateful programs this thread loaded since its last claim."""
    from backends.mlx import runtime

    if not hasattr(runtime.load(), "etmlx_state_claim"):  # a library built before state access: no ids
        return []
    lib = _lib()
    ids = (ctypes.c_uint64 * _MAX_CLAIM)()
    n = lib.etmlx_state_claim(ids, _MAX_CLAIM)
    return list(ids[:min(n, _MAX_CLAIM)])


@dataclass(frozen=True)
class KvBuffer:
    shape: tuple[int, int, int, int]  # rows, kv_heads, slots, head_dim
    dtype: torch.dtype


class ProgramState:
    def __init__(self, state_id: int):
        self.id = state_id
        self._lib = _lib()
        count = _check(self._lib, self._lib.etmlx_state_kv_buffers(state_id))
        self.buffers = []
        for k in range(count):
            shape = (ctypes.c_int64 * 4)()
            dtype = ctypes.c_char_p()
            _check(self._lib, self._lib.etmlx_state_kv_info(state_id, k, shape, ctypes.byref(dtype)))
            name = dtype.value.decode()
            if name not in _DTYPES:
                raise StateError(f"KV buffer {k} has dtype {name}, which the host side does not handle")
            self.buffers.append(KvBuffer(tuple(shape), _DTYPES[name]))

    def read(self, row: int, n: int) -> list[torch.Tensor]:
        """Row `row`'s positions [0, n) of every KV buffer: [kv_heads, n, head_dim] each, the state's dtype."""
        n = max(int(n), 0)
        out = [torch.empty(b.shape[1], n, b.shape[3], dtype=b.dtype) for b in self.buffers]
        flat = torch.empty(sum(t.numel() * t.element_size() for t in out), dtype=torch.uint8)
        _check(self._lib, self._lib.etmlx_state_read(self.id, row, n, flat.data_ptr(), flat.numel()))
        offset = 0
        for t in out:
            size = t.numel() * t.element_size()
            t.view(torch.uint8).view(-1).copy_(flat[offset:offset + size])
            offset += size
        return out

    def write(self, row: int, n: int, entries: list[torch.Tensor]) -> None:
        """The inverse of read: `entries` (as read returns them) become row `row`'s positions [0, n)."""
        if len(entries) != len(self.buffers):
            raise StateError(f"{len(entries)} KV tensors for a program with {len(self.buffers)} KV buffers")
        parts = []
        for k, (t, b) in enumerate(zip(entries, self.buffers)):
            want = (b.shape[1], n, b.shape[3])
            if tuple(t.shape) != want or t.dtype != b.dtype:
                raise StateError(f"KV tensor {k} is {list(t.shape)} {t.dtype}, the program's buffer needs "
                                 f"{list(want)} {b.dtype}")
            parts.append(t.contiguous().view(torch.uint8).view(-1))
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        _check(self._lib, self._lib.etmlx_state_write(self.id, row, n, flat.data_ptr(), flat.numel()))

    def copy(self, src: int, dst: int, n: int) -> None:
        """Row `dst`'s positions [0, n) become row `src`'s (inside the state)."""
        _check(self._lib, self._lib.etmlx_state_copy(self.id, src, dst, n))
