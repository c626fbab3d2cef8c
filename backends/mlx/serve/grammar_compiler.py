"""The server's structured output: a request's Constraint to one Matcher per row, never on the event loop.

Compiling a client's grammar can take seconds (and, unguarded, crash the process): it runs on this
class's own threads (so it cannot starve the threads that tokenize prompts), through the program's
GrammarVocabulary, which checks the server's GrammarLimits and proves the grammar in a bounded worker
process before building it here (llm/decoder/grammar_guard.py). The engine then gets the matchers
ready-made (EngineRequest.matcher), so Engine.check never compiles on the caller's thread.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from backends.mlx.llm.decoder.constraints import Constraint, Matcher, ProgramGrammar
from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.llm.decoder.meta import DecoderMeta


class GrammarCompiler(ProgramGrammar):
    def __init__(self, pte, meta: DecoderMeta, limits: GrammarLimits | None = None):
        self.pte, self.meta = pte, meta
        self.limits = limits or GrammarLimits()
        self._vocabulary = None  # built on the first constrained request (~0.1-1 s)
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=self.limits.grammar_workers,
                                           thread_name_prefix="etmlx-grammar")

    def _matchers(self, constraint: Constraint, count: int) -> list[Matcher]:
        with self._lock:  # one build of the vocabulary, whichever request comes first
            vocabulary = self.vocabulary(self.limits)
        return vocabulary.matchers(constraint, count)

    async def matchers(self, constraint: Constraint, count: int) -> list[Matcher]:
        """`count` matchers for `constraint`; ConstraintError (one line) for a grammar that is refused."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._matchers, constraint, count)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._vocabulary is not None:
            self._vocabulary.close()
