"""HTTP request bodies to JSON without holding up the event loop.

json.loads is one C call that keeps the GIL throughout: a 9 MB body of 700,000 logit_bias entries kept every
other thread and the event loop (/health, other streams) waiting for seconds, on the loop or in a thread alike.
So the work the server does in-process is bounded: a body holds at most `max_values` JSON values (ServeLimits'
max_body_values: far more than a request the program can take, whose prompt ids, messages and logit_bias
entries are each bounded by its max_seq_len and vocabulary). A large body whose commas and brackets could
exceed that (a cheap upper bound: every value but a container's first follows a comma) is parsed and counted
first in a worker process, which holds no GIL of ours; only a body within the limit is then parsed here, in
a thread.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from backends.mlx.serve.json_text import parse_json_text

INLINE_BYTES = 64 * 1024  # parsed at once on the event loop: well under a millisecond
WHAT = "the request body"


def value_bound(raw: bytes) -> int:
    """At least the number of JSON values in `raw` (commas and brackets inside strings count too)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def count_values(value) -> int:
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def parse_body(raw: bytes, error: type[Exception]):
    """`raw` as UTF-8 JSON; `error(message)` (one line) for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{WHAT} is not valid UTF-8 (byte {exc.start})") from None
    return parse_json_text(text, WHAT, error)


def too_large(raw: bytes, max_values: int) -> str | None:
    """In a worker process: why `raw` is refused (not JSON, or more than `max_values` values), or None."""
    try:
        value = parse_body(raw, ValueError)
    except ValueError as exc:
        return str(exc)
    count = count_values(value)
    if count > max_values:
        return (f"{WHAT} holds {count} JSON values; this server takes at most {max_values} "
                "(etmlx serve --max-body-values)")
    return None


class BodyParser:
    """Parses request bodies (see the module's docstring); close() ends its worker processes."""

    def __init__(self, max_values: int, workers: int = 2):
        self.max_values, self._workers, self._pool = max_values, workers, None

    async def parse(self, raw: bytes, error: type[Exception]):
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw, error)
        if value_bound(raw) > self.max_values:
            if self._pool is None:  # spawned: the server's threads (engine, MLX) must not be forked
                self._pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"))
            message = await asyncio.get_running_loop().run_in_executor(self._pool, too_large, raw, self.max_values)
            if message is not None:
                raise error(message)
        return await asyncio.to_thread(parse_body, raw, error)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
