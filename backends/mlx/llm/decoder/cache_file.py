"""A prompt cache saved to a file and loaded back (mlx-lm's save_prompt_cache / load_prompt_cache).

The file (safetensors, written and read here: the plain install has no safetensors package) holds what a
conversation's row of the program's KV cache holds: the tokens of the conversation, the keys and values of
its first n positions (n: how many of those tokens the row holds, runtime/program_state.py), and the
program's identity (the SHA-256 of its .pte and .ptd). Loading writes the entries into a free row of the same program (a different program is refused: its keys and
values would mean nothing there) and records the tokens in the row's cache (runtime/decode_rows.h), so the next
generation of the conversation prefills only what follows them.

Ring programs (a sliding-window layer keeping `window` slots, DecoderMeta.ring_cache) are refused: a ring
slot holds the latest position that maps to it, so a row's slots are not its positions.
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

FORMAT = "etmlx-prompt-cache/1"
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_MAX_HEADER = 1 << 24  # a safetensors header is JSON of the tensors' names, shapes and offsets
_USER = "user."  # prefix of the caller's metadata keys in the file's metadata
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


def _write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the format asks
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:  # written whole, then renamed: a failed save never leaves half a file
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; ValueError (one line) for anything else."""
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
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: its header is not a table")
    metadata = header.pop("__metadata__", {}) or {}
    body, tensors = memoryview(data)[8 + size:], {}
    for name, spec in header.items():
        try:
            dtype, shape, (start, end) = _DTYPES[spec["dtype"]], [int(d) for d in spec["shape"]], spec["data_offsets"]
            count = 1
            for d in shape:
                count *= d
            if not 0 <= start <= end <= len(body) or end - start != count * torch.empty(0, dtype=dtype).element_size():
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{bad}: tensor {name!r} is described wrongly") from None
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8) if end > start else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors, metadata


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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "tokens" not in tensors:
        raise ValueError(f"{path} is not an etmlx prompt cache ({FORMAT!r} expected)")
    if meta.get("program") != program_identity(model.pte):
        raise ValueError(f"{path} was saved from another program than {model.pte}: load it into the program it "
                         "came from (same .pte file)")
    tokens = [int(t) for t in tensors["tokens"].tolist()]
    held = int(meta.get("positions", "0"))
    if not 0 <= held <= min(len(tokens), model.meta.max_seq_len):
        raise ValueError(f"{path}: {held} positions for {len(tokens)} tokens")
    entries = [tensors[f"kv.{k}"] for k in range(sum(1 for name in tensors if name.startswith("kv.")))]
    rows = model.rows
    if rows.active:
        raise RuntimeError("a generation of this model is unfinished: exhaust or close() it before loading")
    slot, _ = rows.choose(tokens, model.meta.batch, reuse=False)  # the least recently used row
    rows.caches.hold(slot, [])  # what it held is gone whatever happens next
    model.method.state.write(slot, held, entries)
    rows.caches.hold(slot, tokens[:held])
    rows.caches.taken(slot)
    return tokens, held, {k[len(_USER):]: v for k, v in meta.items() if k.startswith(_USER)}
