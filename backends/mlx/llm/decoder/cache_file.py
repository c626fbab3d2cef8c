"""A prompt cache saved to a file and loaded back (mlx-lm's save_prompt_cache / load_prompt_cache).

The file (safetensors) holds what a conversation's row of the program's KV cache holds: the tokens of the
conversation, the keys and values of its first n positions (n: how many of those tokens the row holds,
runtime/program_state.py), and the program's identity (the SHA-256 of its .pte and .ptd). Loading
writes the entries into a free row of the same program (a different program is refused: its keys and
values would mean nothing there) and records the tokens in the row's cache (row_caches.py), so the next
generation of the conversation prefills only what follows them.

Ring programs (a sliding-window layer keeping `window` slots, DecoderMeta.ring_cache) are refused: a ring
slot holds the latest position that maps to it, so a row's slots are not its positions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from backends.mlx.llm.decoder.row_caches import common_prefix
from backends.mlx.runtime.runner import weights_beside

FORMAT = "etmlx-prompt-cache/1"
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
            with open(path, "rb") as f:
                _digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
        digest.update(_digests[key].encode())
    return digest.hexdigest()


def _check_no_rings(model, what: str) -> None:
    if model.meta.ring_cache is not False:
        ring = "keeps a sliding-window ring cache" if model.meta.ring_cache else "may keep a ring cache (exported " \
                                                                                  "before DecoderMeta.ring_cache)"
        raise ValueError(f"{model.pte} {ring}, whose slots are not positions: its prompt cache cannot be {what}")


def save(path, model, tokens: list[int], metadata: dict[str, str] | None = None) -> int:
    """Write the conversation `tokens` of `model` (a Decoder or SpeculativeDecoder) with the KV entries of the row
    that holds most of them; returns how many positions went into the file."""
    from safetensors.torch import save_file

    _check_no_rings(model, "saved")
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
    save_file(tensors, str(path), metadata={"format": FORMAT, "program": program_identity(model.pte),
                                            "positions": str(held), **extra})
    return held


def load(path, model) -> tuple[list[int], int, dict[str, str]]:
    """Put a saved conversation into a free row of `model`: (tokens, positions restored, the caller's metadata).
    ValueError (one line) for a file that is not a prompt cache or comes from another program."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt cache: no such file {path}")
    _check_no_rings(model, "loaded")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a prompt cache file: {exc}") from None
    if meta.get("format") != FORMAT or "tokens" not in tensors:
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
    rows.caches.rows[slot].tokens = []  # what it held is gone whatever happens next
    model.method.state.write(slot, held, entries)
    rows.caches.wrote(slot, 0, tokens[:held])
    rows.caches.taken(slot)
    return tokens, held, {k[len(_USER):]: v for k, v in meta.items() if k.startswith(_USER)}
