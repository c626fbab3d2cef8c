"""The runtime's bound on one attention's scores (kernels/attention_blocks.h): a CPU prefill chunk whose float32
scores [B, H, rows, keys] would take more bytes than the limit runs a block of query rows at a time (64 MiB by
default, so a 512-token chunk over 32k keys of Llama-3.1-8B's 32 heads holds 64 MiB of scores instead of 2 GiB).
Process-wide; the rows come out as unblocked attention's."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

from backends.mlx.runtime import load

__all__ = ["DEFAULT_SCORE_LIMIT", "query_blocks", "score_limit", "score_limit_set"]

DEFAULT_SCORE_LIMIT = 64 << 20  # kernels/attention_blocks.h kDefaultAttentionScoreLimit


def _lib() -> ctypes.CDLL:
    lib = load()
    lib.etmlx_attention_score_limit.restype = ctypes.c_uint64
    lib.etmlx_attention_score_limit.argtypes = [ctypes.c_uint64]
    lib.etmlx_attention_query_blocks.restype = ctypes.c_uint64
    return lib


def score_limit() -> int:
    """The limit in bytes now in force."""
    return int(_lib().etmlx_attention_score_limit(0))


@contextmanager
def score_limit_set(nbytes: int) -> Iterator[None]:
    """The limit set to `nbytes` (>= 1) for a block of code, then restored."""
    if nbytes < 1:
        raise ValueError(f"the attention score limit is a positive number of bytes, got {nbytes}")
    lib = _lib()
    before = lib.etmlx_attention_score_limit(nbytes)
    try:
        yield
    finally:
        lib.etmlx_attention_score_limit(before)


def query_blocks() -> int:
    """Query blocks computed in this process since the library loaded (grows only on the blocked path)."""
    return int(_lib().etmlx_attention_query_blocks())
