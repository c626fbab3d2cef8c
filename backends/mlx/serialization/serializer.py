"""Blob = 16-byte header (magic, schema version, payload length) + flatbuffer Graph."""

from __future__ import annotations

import struct

import flatbuffers

from backends.mlx.serialization.generated.fb.Graph import Graph, GraphT
from backends.mlx.serialization.generated.node_table import HEADER_SIZE, MAGIC, SCHEMA_VERSION

FILE_IDENTIFIER = b"ETMX"
_HEADER = struct.Struct("<4sIQ")
assert _HEADER.size == HEADER_SIZE


def serialize(graph: GraphT) -> bytes:
    builder = flatbuffers.Builder(1024)
    builder.Finish(graph.Pack(builder), file_identifier=FILE_IDENTIFIER)
    payload = bytes(builder.Output())
    return _HEADER.pack(MAGIC, SCHEMA_VERSION, len(payload)) + payload


def split_header(blob: bytes) -> tuple[int, bytes]:
    """Return (schema_version, payload); raise ValueError naming what is wrong."""
    if len(blob) < HEADER_SIZE:
        raise ValueError(f"blob: {len(blob)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, length = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"blob: magic {magic!r} is not {MAGIC!r}")
    if version != SCHEMA_VERSION:
        raise ValueError(f"blob: schema version {version} is not {SCHEMA_VERSION}")
    if length != len(blob) - HEADER_SIZE:
        raise ValueError(f"blob: header says {length} payload bytes, found {len(blob) - HEADER_SIZE}")
    return version, bytes(blob[HEADER_SIZE:])


def deserialize(blob: bytes) -> GraphT:
    _, payload = split_header(blob)
    if not Graph.GraphBufferHasIdentifier(payload, 0):
        raise ValueError(f"blob: flatbuffer identifier is not {FILE_IDENTIFIER!r}")
    return GraphT.InitFromPackedBuf(payload, 0)
