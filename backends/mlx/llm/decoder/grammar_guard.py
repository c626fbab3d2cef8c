"""A client's grammar is compiled first in a separate, bounded process, and only then in this one.

Why: llguidance recurses on the grammar's structure and runs in-process with no bound on time or memory;
a $ref chain of 2,500 definitions overflows the stack (SIGSEGV: the server and every client with it),
a 50,000-item choice list takes seconds and a gigabyte. How this process stays safe:

1. grammar_limits.precheck (plain iterative Python) refuses what is over a size, depth or count limit
   before llguidance sees it.
2. `GrammarChecker.check` sends the grammar to a worker process (grammar_worker.py) that compiles it
   under an address-space limit (RLIMIT_AS), within a time limit (the parent kills it past that), on a
   thread with an ordinary 8 MiB stack, and computes its first mask. A crash, a runaway or an
   allocation failure there ends only that worker (a new one replaces it) and the request gets a
   one-line error; a grammar that allows nothing is refused there too.
3. Only a grammar that passed builds its matcher here, on a thread with BUILD_STACK (8 x the worker's):
   the compile is deterministic, so the same grammar needs the same stack and memory here as there,
   and takes the same time (the GIL is released meanwhile).
Grammars that passed are remembered (by hash, PROVEN_CACHE of them): a repeated schema skips step 2.

The matcher itself stays in this process: each step's mask is a few tens of microseconds in-process,
where a round trip to another process per token would cost more than the mask.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict

from backends.mlx.llm.decoder.grammar_limits import ConstraintError, GrammarLimits, one_line
from backends.mlx.llm.decoder.grammar_worker import COMPILE_STACK, MEMORY, read_message, write_message

log = logging.getLogger("etmlx.grammar")
BUILD_STACK = 8 * COMPILE_STACK
PROVEN_CACHE = 256
START_TIMEOUT = 60.0  # seconds a worker may take to start (import llguidance, build the tokenizer)


def on_big_stack(function, *args):
    """function(*args) on a fresh thread with BUILD_STACK; its exception is raised here."""
    result, error = [], []

    def run():
        try:
            result.append(function(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only while creating this thread
        previous = threading.stack_size(BUILD_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-build", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if error:
        raise error[0]
    return result[0]


_STACK_LOCK = threading.Lock()


def _memory(limits: GrammarLimits) -> str:
    return f"compiling the grammar needed more than {limits.grammar_memory_mb} MiB (the limit; etmlx serve --grammar-memory-mb)"


class _Worker:
    def __init__(self, init: dict):
        self.timed_out = False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), MALLOC_ARENA_MAX="2")
        self.process = subprocess.Popen([sys.executable, "-m", "backends.mlx.llm.decoder.grammar_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
        write_message(self.process.stdin, init)
        if self._reply(START_TIMEOUT) is None:
            self.kill()
            raise ConstraintError("the grammar compiler could not start")

    def _reply(self, timeout: float) -> dict | None:
        """The next message, or None when the worker died or gave no answer within `timeout` (then it is
        killed, so `why_gone` can tell a runaway from a crash)."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.timed_out = True
            self.kill()
            return None
        return read_message(self.process.stdout)

    def ask(self, grammar: str, timeout: float) -> dict | None:
        try:
            write_message(self.process.stdin, {"grammar": grammar})
        except (BrokenPipeError, OSError):
            return None
        return self._reply(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def why_gone(self, limits: GrammarLimits) -> str:
        """One line for a worker that gave no answer (it has ended or is ended now)."""
        try:
            self.process.wait(timeout=5.0)  # it closed its pipe as it died: its exit status follows
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        code = self.process.returncode
        if self.timed_out or code == -signal.SIGXCPU:
            return (f"compiling the grammar took longer than {limits.grammar_compile_timeout:g} s (the limit; "
                    "etmlx serve --grammar-compile-timeout)")
        if code == -signal.SIGSEGV:
            return "the grammar is too deeply nested to compile (the compiler ran out of stack)"
        if code in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGBUS):
            return _memory(limits)
        return f"the grammar compiler failed on this grammar (exit {code})"


class GrammarChecker:
    """A pool of up to `limits.grammar_workers` compile processes for one tokenizer; check() is blocking
    (call it off the event loop) and thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], limits: GrammarLimits):
        self.limits = limits
        self._init = {"tokenizer_json": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos_token_ids),
                      "memory_mb": limits.grammar_memory_mb, "max_choices": limits.max_choices,
                      "timeout": limits.grammar_compile_timeout}
        self._idle: queue.LifoQueue = queue.LifoQueue()  # the warm worker first: a second starts only when needed
        for _ in range(limits.grammar_workers):
            self._idle.put(None)  # a slot whose worker starts on first use
        self._proven: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def check(self, grammar: str) -> None:
        """Raise ConstraintError (one line) unless `grammar` compiles in a worker within the limits."""
        key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            if key in self._proven:
                self._proven.move_to_end(key)
                return
        worker = self._idle.get()
        try:
            if worker is None or worker.process.poll() is not None:
                worker = _Worker(self._init)
            reply = worker.ask(grammar, self.limits.grammar_compile_timeout)
            if reply is None:
                message = worker.why_gone(self.limits)
                log.warning("grammar worker %d ended: %s", worker.process.pid, message)
                worker = None
                raise ConstraintError(message)
        finally:
            self._idle.put(None if self._closed else worker)
        if "error" in reply:
            raise ConstraintError(_memory(self.limits) if reply["error"] == MEMORY else one_line(reply["error"]))
        with self._lock:
            self._proven[key] = None
            while len(self._proven) > PROVEN_CACHE:
                self._proven.popitem(last=False)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()
