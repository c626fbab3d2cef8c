"""The server's structured output: a request's Constraint to one Matcher per row, never on the event loop.

Compiling a client's grammar can take seconds (and, unguarded, crash the process): it runs on this
class's own threads (so it cannot starve the threads that tokenize prompts), through the program's
GrammarVocabulary, which checks the server's GrammarLimits and proves the grammar in a bounded worker
process before building it here (llm/decoder/grammar_guard.py). The engine then gets the matchers
ready-made (EngineRequest.matcher), so Engine.check never compiles on the caller's thread.

The last CACHE_SIZE grammars compiled stay as fresh matchers to copy: a client that repeats its schema or its
tools (every turn of a tool conversation) gets its matchers without a compile (a copy shares the compiled grammar).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from backends.mlx.llm.decoder.constraints import Constraint, Matcher, ProgramGrammar
from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.llm.decoder.meta import DecoderMeta

CACHE_SIZE = 32


def _key(constraint: Constraint) -> str | None:
    """The cache key of a constraint (None: not cached, a spec too deep to serialize; the compile refuses it)."""
    spec = constraint.spec
    try:
        return constraint.kind + "\0" + (spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))
    except (RecursionError, TypeError, ValueError):
        return None


class GrammarCompiler(ProgramGrammar):
    def __init__(self, pte, meta: DecoderMeta, limits: GrammarLimits | None = None):
        self.pte, self.meta = pte, meta
        self.limits = limits or GrammarLimits()
        self._vocabulary = None  # built on the first constrained request (~0.1-1 s)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Matcher] = OrderedDict()  # grammar key -> a fresh matcher to copy
        self._threads = ThreadPoolExecutor(max_workers=self.limits.grammar_workers,
                                           thread_name_prefix="etmlx-grammar")

    def _matchers(self, constraint: Constraint, count: int) -> list[Matcher]:
        key = _key(constraint)
        with self._lock:  # one build of the vocabulary, whichever request comes first
            vocabulary = self.vocabulary(self.limits)
            fresh = self._compiled.get(key) if key is not None else None
            if fresh is not None:
                self._compiled.move_to_end(key)
        if fresh is None:
            fresh = vocabulary.matchers(constraint, 1)[0]
            if key is None:
                return [fresh] + [fresh.copy() for _ in range(count - 1)]
            with self._lock:
                self._compiled[key] = fresh
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return [fresh.copy() for _ in range(count)]

    async def matchers(self, constraint: Constraint, count: int) -> list[Matcher]:
        """`count` matchers for `constraint`; ConstraintError (one line) for a grammar that is refused."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._matchers, constraint, count)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._vocabulary is not None:
            self._vocabulary.close()
