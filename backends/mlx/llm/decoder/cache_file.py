"""A prompt cache saved to a file and loaded back (mlx-lm's save_prompt_cache / load_prompt_cache).

The file (safetensors, written and read here: the plain install has no safetensors package) holds what a
conversation's row of the program's KV cache holds: the tokens of the conversation, the keys and values of
its first n positions (n: how many of those tokens the row holds, runtime/program_state.py), and the
program's identity (the SHA-256 of its .pte and .ptd). Loading writes the entries into a free row of the same program (a different program is refused: its keys and
values would mean nothing there) and records the tokens in the row's cache (runtime/decode_rows.h), so the next
generation of the conversation prefills only what follows them.

A --kv-bits program's cache is its packed keys and values and their scales and biases (kv_quant.py), each a
buffer of the same [rows, heads, positions, .] form: the file holds them as the program does (uint8 and float),
and each is checked against its buffer's dtype and shape like a float cache's.

Ring programs (a sliding-window layer keeping `window` slots, DecoderMeta.ring_cache) are refused: a ring
slot holds the latest position that maps to it, so a row's slots are not its positions.

A file is input like any other: its header is parsed within limits (size, nesting), every field is checked
before use (names, dtypes, shapes, offsets, positions, token ids, the KV tensors against the program's
buffers), and a SHA-256 over the header and all tensor bytes (metadata "checksum") must match, so a flipped
bit in the keys and values is refused instead of silently changing the reply. Each failure is a one-line
ValueError.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from backends.mlx.llm.decoder.decode_rows import common_prefix
from backends.mlx.runtime.runner import weights_beside

FORMAT = "etmlx-prompt-cache/2"  # /2: with the checksum
# uint8: a --kv-bits program's packed keys and values (llm/decoder/kv_quant.py), beside their float scales and biases
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.uint8: "U8"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_MAX_HEADER = 1 << 24  # a safetensors header is JSON of the tensors' names, shapes and offsets
_USER = "user."  # prefix of the caller's metadata keys in the file's metadata
_CHECKSUM = "checksum"  # metadata key: sha256 of the header without it and of the tensor bytes (_checksum)
_digests: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: a program is hashed once per process


def program_identity(pte: Path) -> str:
    """The SHA-256 of the program's file and its external weights, if any (the .ptd beside it)."""
    files = [Path(pte)] + [p for p in [weights_beside(Path(pte))] if p is not None]
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _digests:
            file_digest = hashlib.sha256()
            with open(path, "rb") as f:  # hashlib.file_digest is 3.11+; etmlx runs on 3.10
                for block in iter(lambda: f.read(1 << 20), b""):
                    file_digest.update(block)
            _digests[key] = file_digest.hexdigest()
        digest.update(_digests[key].encode())
    return digest.hexdigest()


def _checksum(header: dict, body) -> str:
    """What the metadata's checksum holds: SHA-256 of the header (canonical JSON, without the checksum) and of
    the tensor bytes."""
    digest = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    digest.update(body)
    return digest.hexdigest()


def _write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    header, offset, blobs = {"__metadata__": dict(metadata)}, 0, []
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    header["__metadata__"][_CHECKSUM] = _checksum(header, b"".join(blobs))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the format asks
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:  # written whole, then renamed: a failed save never leaves half a file
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file written by _write_safetensors, its checksum verified;
    ValueError (one line) for anything else."""
    bad = f"{path} is not a prompt cache file"
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{bad}: too short")
    size = struct.unpack("<Q", data[:8])[0]
    if size > min(_MAX_HEADER, len(data) - 8):
        raise ValueError(f"{bad}: bad header length")
    try:
        header = json.loads(data[8:8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{bad}: its header is not JSON") from None
    except RecursionError:  # json's parser stops at the interpreter's recursion limit
        raise ValueError(f"{bad}: its header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: its header is not a table")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise ValueError(f"{bad}: its __metadata__ is not a table of strings")
    body = memoryview(data)[8 + size:]
    specs = {name: _tensor_spec(bad, name, spec, len(body)) for name, spec in header.items() if name != "__metadata__"}
    ends = sorted((start, end) for _, _, start, end in specs.values())
    if any(a[1] > b[0] for a, b in zip(ends, ends[1:])) or (ends[-1][1] if ends else 0) != len(body):
        raise ValueError(f"{bad}: its tensors overlap or leave bytes unaccounted for")
    stored = metadata.pop(_CHECKSUM, None)
    if stored is None:
        raise ValueError(f"{bad}: it has no checksum (metadata {_CHECKSUM!r})")
    if stored != _checksum(header, body):
        raise ValueError(f"{path}: the checksum does not match its contents (the file was altered or damaged)")
    tensors = {}
    for name, (dtype, shape, start, end) in specs.items():
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8) if end > start else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors, metadata


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_spec(bad: str, name: str, spec, body_size: int) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, start, end) of a header entry, each checked: a known dtype, dims >= 0, offsets inside the
    body spanning exactly the shape's bytes."""
    wrong = f"{bad}: tensor {name!r} is described wrongly"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(wrong)
    dtype, shape, offsets = _DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None, spec["shape"], \
        spec["data_offsets"]
    if dtype is None or not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) \
            or len(shape) > 8 or not isinstance(offsets, list) or len(offsets) != 2 \
            or not all(_is_int(o) for o in offsets):
        raise ValueError(wrong)
    count = 1
    for d in shape:
        count *= d
    start, end = offsets
    if not 0 <= start <= end <= body_size or end - start != count * torch.empty(0, dtype=dtype).element_size():
        raise ValueError(wrong)
    return dtype, shape, start, end


def check_no_rings(model, what: str) -> None:
    if model.meta.ring_cache is not False:
        ring = "keeps a sliding-window ring cache" if model.meta.ring_cache else "may keep a ring cache (exported " \
                                                                                  "before DecoderMeta.ring_cache)"
        raise ValueError(f"{model.pte} {ring}, whose slots are not positions: its prompt cache cannot be {what}")


def save(path, model, tokens: list[int], metadata: dict[str, str] | None = None) -> int:
    """Write the conversation `tokens` of `model` (a Decoder or SpeculativeDecoder) with the KV entries of the row
    that holds most of them; returns how many positions went into the file."""
    check_no_rings(model, "saved")
    rows = model.rows
    if rows.active:
        raise RuntimeError("a generation of this model is unfinished: exhaust or close() it before saving")
    slot, held = max(((s, common_prefix(rows.caches.held(s), tokens)) for s in range(model.meta.batch)),
                     key=lambda pair: pair[1])
    entries = model.method.state.read(slot, held)
    extra = {f"{_USER}{k}": v for k, v in (metadata or {}).items()}
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in (metadata or {}).items()):
        raise TypeError("metadata must map str to str (as mlx-lm's)")
    tensors = {"tokens": torch.tensor(list(tokens), dtype=torch.int64)}
    tensors.update({f"kv.{k}": t for k, t in enumerate(entries)})
    _write_safetensors(path, tensors, {"format": FORMAT, "program": program_identity(model.pte),
                                       "positions": str(held), **extra})
    return held


def load(path, model) -> tuple[list[int], int, dict[str, str]]:
    """Put a saved conversation into a free row of `model`: (tokens, positions restored, the caller's metadata).
    ValueError (one line) for a file that is not a prompt cache or comes from another program."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt cache: no such file {path}")
    check_no_rings(model, "loaded")
    tensors, meta = _read_safetensors(path)
    if meta.get("format") != FORMAT or "tokens" not in tensors:
        raise ValueError(f"{path} is not an etmlx prompt cache ({FORMAT!r} expected)")
    if meta.get("program") != program_identity(model.pte):
        raise ValueError(f"{path} was saved from another program than {model.pte}: load it into the program it "
                         "came from (same .pte file)")
    tokens, held, entries = _checked_contents(path, tensors, meta, model)
    rows = model.rows
    if rows.active:
        raise RuntimeError("a generation of this model is unfinished: exhaust or close() it before loading")
    slot, _ = rows.choose(tokens, model.meta.batch, reuse=False)  # the least recently used row
    rows.caches.hold(slot, [])  # what it held is gone whatever happens next
    model.method.state.write(slot, held, entries)
    rows.caches.hold(slot, tokens[:held])
    rows.caches.taken(slot)
    return tokens, held, {k[len(_USER):]: v for k, v in meta.items() if k.startswith(_USER)}


def _checked_contents(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], model):
    """(tokens, positions, KV entries) of a read file, each checked against `model`'s program."""
    buffers, vocab = model.method.state.buffers, model.meta.vocab_size
    names = {"tokens"} | {f"kv.{k}" for k in range(len(buffers))}
    if set(tensors) != names:
        raise ValueError(f"{path}: tensors {sorted(tensors)[:8]} are not this program's (tokens and "
                         f"kv.0..kv.{len(buffers) - 1})")
    ids = tensors["tokens"]
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{path}: 'tokens' must be a list of int64 token ids, is {list(ids.shape)} {ids.dtype}")
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(f"{path}: its tokens must be ids in [0, {vocab})")
    tokens = ids.tolist()
    text = meta.get("positions", "")
    if not (text.isascii() and text.isdigit() and len(text) < 10):
        raise ValueError(f"{path}: 'positions' must be a count of tokens, got {text[:40]!r}")
    held = int(text)
    if not held <= min(len(tokens), model.meta.max_seq_len):
        raise ValueError(f"{path}: {held} positions for {len(tokens)} tokens")
    entries = [tensors[f"kv.{k}"] for k in range(len(buffers))]
    for k, (t, b) in enumerate(zip(entries, buffers)):
        want = [b.shape[1], held, b.shape[3]]
        if list(t.shape) != want or t.dtype != b.dtype:
            raise ValueError(f"{path}: KV tensor {k} is {list(t.shape)} {t.dtype}, this program's needs {want} "
                             f"{b.dtype}")
    return tokens, held, entries
