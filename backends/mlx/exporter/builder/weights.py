"""Where a constant's bytes go: inline in the delegate blob, or ExecuTorch named data.

Named data is what ExecuTorch gives delegates for large shared bytes: `to_executorch` writes it into the
.pte's segments (`placement="pte"`, the default) or, with an external tag, into a separate `.ptd`
(`placement="external"`), so weights do not pass through the FlatBuffers blob (and its 2 GiB limit). What
the runtime does with them at load on each device (a copy on the CPU and CUDA builds) is in docs/weights.md.
Each key ends in the CRC-32 of its bytes, which the runtime checks at load (runtime/named_constant.cpp): a
damaged or shifted weight is a load error naming the constant, not different tokens. Small constants
(scalars, norms' epsilons, masks) stay inline: a named entry costs a key, a segment entry and padding.
The store holds each weight's bytes where the tensor has them (TensorBytes), not a copy: at real size a copy
was one more time the weights in memory until the file was written (docs/weights.md).
"""

from __future__ import annotations

import hashlib
import zlib

import torch
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir._serialize._named_data_store import NamedDataStore, NamedDataStoreOutput

PLACEMENTS = ("inline", "pte", "external")
# The external tag ExecuTorch names the .ptd after; ExportResult.save renames it to FILE.ptd.
EXTERNAL_TAG = "etmlx_weights"
# Constants of at least this many bytes become named data.
NAMED_MIN_BYTES = 1024
# Alignment of each named tensor in its segment / .ptd: enough for any dtype and for SIMD loads, so
# the runtime can alias the mapped bytes instead of copying them.
ALIGNMENT = 64
KEY_PREFIX = "etmlx/w/"


class WeightStore:
    def __init__(self, placement: str = "pte"):
        if placement not in PLACEMENTS:
            raise ValueError(f"weights placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        self.store = NamedDataStore()
        self.count = 0

    def key_for(self, tensor: torch.Tensor) -> str | None:
        """Stores a contiguous CPU tensor's bytes as named data and returns its key, or None if it stays inline.

        The key is the content hash and size, so identical tensors of several delegates or methods share one
        entry and the same checkpoint always exports the same keys, and then the bytes' CRC-32 (zlib's, 8 hex
        digits), which the runtime verifies as it copies them (SHA-256 would cost ~4x more at every load)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.placement == "inline" or nbytes < NAMED_MIN_BYTES:
            return None
        # A uint8 view of the tensor's own storage: hashing and the store's one copy read it in place.
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        sha256 = hashlib.sha256(memoryview(raw)).digest()
        digest = sha256.hex()[:40]
        key = f"{KEY_PREFIX}{digest}-{nbytes}-{zlib.crc32(memoryview(raw)):08x}"
        tag = EXTERNAL_TAG if self.placement == "external" else None
        self.store.add_named_data(key, TensorBytes(raw, sha256), alignment=ALIGNMENT, external_tag=tag)
        self.count += 1
        return key

    def output(self) -> NamedDataStoreOutput | None:
        return self.store.get_named_data_store_output() if self.count else None


class TensorBytes(FileBackedData):
    """A tensor's bytes as ExecuTorch's serializer takes a buffer, read in place: the store and the `.pte`
    writer (`Cord.write_to_file`) accept `bytes` or FileBackedData, whose interface (length, prefix, sha256,
    to_bytes, write_to_file) this implements over the tensor's own memory (an mmap of the checkpoint for an
    mlx-lm directory), so no copy of the weights is made. The tensor must not change until the program is
    written: the exporter's constants are the module's, which nothing writes during an export."""

    def __init__(self, raw, sha256: bytes | None = None):
        # No FileBackedData.__init__: there is no file (and so nothing to remove when closed).
        self._view = memoryview(raw).cast("B")
        self._raw = raw  # keeps the tensor's storage alive
        self._path = None
        self._size = self._view.nbytes
        self._sha256 = sha256  # the store compares digests to share identical buffers
        self._finalizer = None

    def prefix(self, size: int) -> bytes:
        return self._view[:size].tobytes()

    def sha256(self) -> bytes:
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self._view).digest()
        return self._sha256

    def to_bytes(self) -> bytes:
        return self._view.tobytes()

    def write_to_file(self, outfile) -> None:
        outfile.write(self._view)
