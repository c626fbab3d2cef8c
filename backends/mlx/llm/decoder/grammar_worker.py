"""The isolated grammar compile: `python -m backends.mlx.llm.decoder.grammar_worker`, one per slot of
grammar_guard.GrammarChecker's pool.

It builds llguidance's tokenizer once (from the first message), caps its own address space
(RLIMIT_AS: its size after start-up plus the memory limit), then answers one request per grammar:
validate it, build the matcher on a thread with an ordinary 8 MiB stack (COMPILE_STACK; the server
builds its own copy on a far bigger stack, so a grammar that fits here fits there), and compute the
first mask both ways the server does (one row on a plain thread, several through llguidance's
executor), then take the first token it allows. A grammar that allows nothing (no token and no end of
sequence can come first), or fails at its first token, is refused here. A grammar that overflows the stack or the memory kills only this process; the parent reports it.

Messages both ways: 4-byte big-endian length, then UTF-8 JSON.
  in:  {"tokenizer_json", "vocab_size", "eos", "memory_mb", "max_choices", "timeout"} once, then {"grammar"} per request
  out: {"ready": true} once, then {"ok": true} or {"error": "one line"} per request
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading

COMPILE_STACK = 8 * 1024 * 1024
MEMORY = "memory"  # the reply's error when the compile ran out of memory (the parent words it)


def read_message(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    return json.loads(body.decode("utf-8")) if len(body) == size else None


def write_message(stream, message: dict) -> None:
    body = json.dumps(message).encode("utf-8")
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def parser_limits(max_choices: int):
    """llguidance's limits, the same here and in the server. A choice list is one grammar row of that many
    items, and llguidance refuses a row over max_items_in_row (2,000) only at the first token, after the
    mask allowed it: the row limit follows --max-choices. verbose_errors=False: llguidance's messages
    leave out its parser state and the grammar."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=max(2000, max_choices + 8), verbose_errors=False)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class _Compiler:
    def __init__(self, init: dict):
        import numpy as np
        from llguidance import LLExecutor, LLTokenizer

        self.np = np
        self.tokenizer = LLTokenizer(init["tokenizer_json"], n_vocab=init["vocab_size"], eos_token=init["eos"])
        self.words = (init["vocab_size"] + 31) // 32
        self.executor = LLExecutor()
        self.limits = parser_limits(init["max_choices"])

    def check(self, grammar: str) -> dict:
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        if is_error:
            return {"error": str(messages[0]) if messages else "rejected"}
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            return {"error": matcher.get_error()}
        np = self.np
        rows = [matcher.deep_copy(), matcher.deep_copy()]
        many = np.zeros((len(rows), self.words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(rows)], many.ctypes.data,
                                              self.words * 4, len(rows))
        one = np.zeros(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(one.ctypes.data, one.nbytes)
        if any(m.is_error() for m in [matcher, *rows]) or not one.any():
            return {"error": "the grammar allows nothing: no token and no end of sequence can come first "
                             "(an empty regex class, a rule with no base case, a $ref cycle)"}
        # The first token the mask allows must be taken too (a row over llguidance's limits fails only here).
        first = int(np.flatnonzero(np.unpackbits(one.view(np.uint8), bitorder="little"))[0])
        if not rows[0].consume_token(first) or rows[0].is_error():
            return {"error": f"the grammar fails at its first token: {rows[0].get_error()}"}
        return {"ok": True}


def _on_thread(function, *args):
    """function(*args) on a fresh thread with COMPILE_STACK (the server's own threads have at least this)."""
    result: list = []

    def run():
        try:
            result.append(function(*args))
        except MemoryError:
            result.append({"error": MEMORY})
        except BaseException as exc:  # noqa: BLE001 - any failure (a Rust panic too) is this grammar's
            result.append({"error": f"{type(exc).__name__}: {exc}"})

    try:
        threading.stack_size(COMPILE_STACK)
        thread = threading.Thread(target=run, name="grammar-compile")
        thread.start()
        thread.join()
    except (RuntimeError, MemoryError):  # no room left for the thread's stack: the memory limit
        return {"error": MEMORY}
    return result[0] if result else {"error": MEMORY}


def _cpu_backstop(timeout: float) -> None:
    """The parent kills a compile past `timeout`; should the parent be gone, the kernel ends this one
    (SIGXCPU) once it has used several times that in CPU seconds (all its threads count)."""
    if timeout > 0:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime + 8 * timeout + 10)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)  # only the soft limit moves (raising hard needs root)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main() -> int:
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the pipe
    init = read_message(source)
    if init is None:
        return 1
    compiler = _Compiler(init)
    if init.get("memory_mb"):
        limit = _address_space() + int(init["memory_mb"]) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_message(sink, {"ready": True})
    while (message := read_message(source)) is not None:
        _cpu_backstop(float(init.get("timeout") or 0))
        write_message(sink, _on_thread(compiler.check, message["grammar"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
