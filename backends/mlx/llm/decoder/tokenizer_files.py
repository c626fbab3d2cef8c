"""The tokenizer inside a decoder .pte: the files `save_pretrained` writes, one named blob each.

Storing the files themselves (tokenizer.json, tokenizer_config.json with the special tokens, the
chat template, ...) rather than a digest of them means transformers rebuilds exactly the tokenizer
that was exported, and C++ (tools/etmlx_decode) reads the same tokenizer.json with its own library.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from backends.mlx.llm.decoder.light_tokenizer import load_tokenizer as load_directory
from backends.mlx.llm.decoder.meta import TOKENIZER_PREFIX, DecoderMeta
from backends.mlx.runtime.pte_metadata import named_data


def as_tokenizer(tokenizer):
    """A transformers tokenizer, or a directory holding one, as a tokenizer."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def prompt_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids `tokenizer(text)` adds before and after the text's own (BOS, ...)."""
    probe = "a b"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    raise ValueError(f"the tokenizer's special tokens are not a prefix/suffix of the text ({full} vs {plain})")


def tokenizer_blobs(tokenizer) -> dict[str, bytes]:
    """Named data for a transformers tokenizer: the files save_pretrained writes."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = sorted(p for p in Path(tmp).iterdir() if p.is_file())
        return {TOKENIZER_PREFIX + p.name: p.read_bytes() for p in files}


def has_tokenizer(pte: Path, meta: DecoderMeta) -> bool:
    return meta.tokenizer_embedded


def load_tokenizer(pte: Path, meta: DecoderMeta):
    """The program's tokenizer, or None when it was exported without one. Plain tokenizer.json
    tokenizers load without transformers (light_tokenizer.py), others through AutoTokenizer."""
    pte = Path(pte)
    if not meta.tokenizer_embedded:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return load_directory(extract_tokenizer(pte, Path(tmp)))


def extract_tokenizer(pte: Path, directory: Path) -> Path:
    """Writes the tokenizer files embedded in `pte` into `directory` (as save_pretrained laid them out)."""
    blobs = named_data(pte, prefix=TOKENIZER_PREFIX)
    if TOKENIZER_PREFIX + "tokenizer_config.json" not in blobs:
        raise ValueError(f"{pte}: the metadata says the tokenizer is embedded but the program has no "
                         f"{TOKENIZER_PREFIX}tokenizer_config.json")
    directory.mkdir(parents=True, exist_ok=True)
    for key, blob in blobs.items():
        name = key[len(TOKENIZER_PREFIX):]
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{pte}: named data {key!r} is not a tokenizer file name")
        (directory / name).write_bytes(blob)
    return directory


def tokenizer_json(pte: Path, meta: DecoderMeta) -> str | None:
    """The program's tokenizer.json text (what a grammar engine reads), or None when it has none."""
    pte = Path(pte)
    if not meta.tokenizer_embedded:
        return None
    key = TOKENIZER_PREFIX + "tokenizer.json"
    blob = named_data(pte, [key]).get(key)
    return None if blob is None else blob.decode()


class ProgramTokenizer:
    """The tokenizer of a decoder program, loaded on first use: for loops that hold `pte` and `meta`."""

    pte: Path
    meta: DecoderMeta
    _tokenizer = None

    @property
    def has_tokenizer(self) -> bool:
        return has_tokenizer(self.pte, self.meta)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.pte, self.meta)
            if self._tokenizer is None:
                raise FileNotFoundError(f"{self.pte} has no tokenizer: pass token ids (--prompt-ids) or re-export "
                                        "from a checkpoint that has one")
        return self._tokenizer
