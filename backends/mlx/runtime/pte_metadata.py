"""Read the named data a .pte carries (ExecuTorch's `Program.named_data`), without loading the program.

The decoder exporter stores its metadata and tokenizer there, so a .pte describes itself. Importing
executorch.runtime (7 s, it pulls torchao) or executorch.exir (3 s) only to read a few bytes would
dominate a short `generate`, so this walks the flatbuffer with the `flatbuffers` package's Table
primitives: the header, then Program.named_data -> Program.segments -> the bytes. The file is
memory-mapped; only the pages holding the header, the flatbuffer tables and the wanted blobs are read.

Layout (executorch/schema/program.fbs, exir/_serialize/_program.py):
  [0:4] root table offset, [4:8] file identifier "ET12", [8:40] extended header "eh00"
  (program_size, segment_base_offset), then the Program flatbuffer, then the segments.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Iterable

from flatbuffers import number_types as N
from flatbuffers.table import Table

_IDENTIFIER = b"ET12"
_HEADER_MAGIC = b"eh00"
# Field slots of the tables read here, as vtable offsets (4 + 2 * slot, in schema order).
_PROGRAM_SEGMENTS = 4 + 2 * 4
_PROGRAM_NAMED_DATA = 4 + 2 * 7
_NAMED_DATA_KEY, _NAMED_DATA_SEGMENT = 4, 6
_SEGMENT_OFFSET, _SEGMENT_SIZE = 4, 6


class PteFormatError(ValueError):
    """The file is not a .pte this reader understands."""


def _vector(table: Table, slot: int) -> list[Table]:
    off = table.Offset(slot)
    if not off:
        return []
    start = table.Vector(off)
    return [Table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(table.VectorLen(off))]


def _field(table: Table, slot: int, kind) -> int:
    off = table.Offset(slot)
    return table.Get(kind, table.Pos + off) if off else 0


def _entries(buf, path: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """key -> (absolute offset, size) of every named blob, and the file size."""
    if len(buf) < 40 or buf[4:8] != _IDENTIFIER:
        raise PteFormatError(f"{path} is not an ExecuTorch program (no {_IDENTIFIER.decode()} identifier)")
    if buf[8:12] != _HEADER_MAGIC:
        # Programs without segments carry no extended header, and so no named data outside the flatbuffer.
        return {}, len(buf)
    segment_base = struct.unpack_from("<Q", buf, 24)[0]
    root = struct.unpack_from("<I", buf, 0)[0]
    if root >= len(buf):
        raise PteFormatError(f"{path}: the program's root offset points past the end of the file")
    program = Table(buf, root)
    segments = [(_field(s, _SEGMENT_OFFSET, N.Uint64Flags), _field(s, _SEGMENT_SIZE, N.Uint64Flags))
                for s in _vector(program, _PROGRAM_SEGMENTS)]
    out = {}
    for entry in _vector(program, _PROGRAM_NAMED_DATA):
        key_off = entry.Offset(_NAMED_DATA_KEY)
        key = entry.String(entry.Pos + key_off).decode() if key_off else ""
        index = _field(entry, _NAMED_DATA_SEGMENT, N.Uint32Flags)
        if index >= len(segments):
            raise PteFormatError(f"{path}: named data {key!r} points at segment {index} of {len(segments)}")
        offset, size = segments[index]
        start = segment_base + offset
        if start + size > len(buf):
            raise PteFormatError(f"{path}: named data {key!r} runs past the end of the file (truncated?)")
        out[key] = (start, size)
    return out, len(buf)


def named_data(pte, keys: Iterable[str] | None = None, *, prefix: str | None = None) -> dict[str, bytes]:
    """The named blobs of `pte` (a path): all of them, those in `keys` that exist, or those whose key
    starts with `prefix`. A key the program lacks is simply absent from the result."""
    path = Path(pte)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise PteFormatError(f"{path} is empty, not an ExecuTorch program") from None
    with buf:
        try:
            entries, _ = _entries(buf, path)
        except (struct.error, IndexError) as exc:
            raise PteFormatError(f"{path}: the program's flatbuffer is malformed ({exc})") from None
        wanted = set(keys) if keys is not None else None
        return {key: bytes(buf[start:start + size]) for key, (start, size) in entries.items()
                if (wanted is None or key in wanted) and (prefix is None or key.startswith(prefix))}


def main(argv=None) -> int:
    """`python -m backends.mlx.runtime.pte_metadata FILE.pte [KEY]`: list the named data, or print one blob."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m backends.mlx.runtime.pte_metadata FILE.pte [KEY]", file=sys.stderr)
        return 2
    blobs = named_data(args[0], args[1:] or None)
    if len(args) == 2:
        if args[1] not in blobs:
            print(f"{args[0]} has no named data {args[1]!r}", file=sys.stderr)
            return 1
        sys.stdout.buffer.write(blobs[args[1]])
        return 0
    for key, blob in blobs.items():
        print(f"{len(blob):>10}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
