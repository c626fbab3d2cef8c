"""Speculative decoding of one sequence over a draft-verifying program (`etmlx export --draft-tokens K`).

    decoder = SpeculativeDecoder("model.pte")
    tokens = list(decoder.stream(prompt_ids, 64, params, draft=NgramDraft()))
    decoder.stats   # DraftStats(calls, proposed, accepted) of the last stream

A thin driver: the sequence is a batch of one request driven through DecodeRows (decode_rows.py), as the plain
loop (loop.py `decode_alone`) and the server drive it, so the step rules live there: before each call, the
prefill included, the row's source (draft_sources.py) proposes up to k drafts (k from the DraftBudget); the
program returns how many it accepts (n) and the next token, so a call emits n + 1 tokens. The seeds follow the
plain loop's schedule (output token j draws with params.seed + j), and the program's acceptance draws are the
plain sampler's own (sampler/draft_verification.py): greedy and seeded sampled tokens are the plain loop's
tokens, whatever the source proposes. A batched program decodes the sequence in one row; the other rows idle.

The rows' KV caches outlive a stream, as the plain loop's do (runtime/decode_rows.h): `stream(..., reuse=True)`
prefills only what a row does not hold yet (`etmlx chat`, the Python API's prompt_cache). A rejected draft's
position is past the record's end, so the next call overwrites it before any reuse could count it. Draft
programs keep full-length caches (no rings).
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from backends.mlx.llm.decoder.constraints import Constraint, ProgramGrammar
from backends.mlx.llm.decoder.decode_rows import DecodeRows, Row, Sequence
from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.loop import check_prompt, decode_alone
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.tokenizer_files import ProgramTokenizer
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method


@dataclass
class DraftStats:
    calls: int = 0  # program calls, the prefill included
    proposed: int = 0  # drafted tokens sent for verification
    accepted: int = 0  # of those, accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpeculativeDecoder(ProgramTokenizer, ProgramGrammar):
    def __init__(self, pte: Path, meta: DecoderMeta | None = None, method=None):
        self.pte = Path(pte)
        if not self.pte.is_file():
            raise FileNotFoundError(f"{self.pte} does not exist")
        self.meta = meta or DecoderMeta.load(self.pte)
        if not self.meta.draft_tokens:
            raise ValueError(f"{self.pte} does not verify drafts: export it with --draft-tokens K")
        self.method = method or load_method(self.pte)
        self.meta.check_program(self.pte, self.method.input_specs(), drafts=True)
        # the step rules; its row caches persist between streams
        copy_rows = self.method.copy_rows if getattr(self.method, "can_copy_rows", False) else None
        self.rows = DecodeRows(self.meta, copy_rows=copy_rows)
        self.first_call = (0.0, 0)  # (time, tokens) when the last stream's first call returned
        self.last_cached = 0  # prompt tokens the last stream found in its row's cache (not prefilled)
        self._row: Row | None = None  # the last stream's row
        self._vocabulary = None  # structured output's, built on the first constrained stream

    @property
    def stats(self) -> DraftStats:
        """The last stream's calls and drafts (so far, while it runs)."""
        row = self._row
        return DraftStats(row.calls, row.proposed, row.accepted) if row is not None else DraftStats()

    def _started(self, row: Row) -> None:
        self._row, self.last_cached = row, row.cached

    def stream(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None, draft=None,
               stop_at_eos: bool = True, budget: DraftBudget | None = None, reuse: bool = False,
               constraint: Constraint | None = None) -> Iterator[int]:
        """Token ids, as the plain loop (loop.py) would yield them; `draft`: a source (draft_sources.py) or None;
        `budget`: how many drafts per call (default: a DraftBudget of up to K).
        `reuse`: start from the longest prefix of the prompt that a row's cache still holds (`last_cached`).
        `constraint`: structured output (a program exported with the mask input), drafts cut where the grammar
        rejects one, each verified position under its own mask: the plain mask program's tokens."""
        params = params or SamplingParams()
        params.check(self.meta.config, self.meta.vocab_size)
        prompt = check_prompt(self.meta, prompt_ids, max_tokens)
        matcher = self.matcher(constraint) if constraint is not None else None
        request = Sequence(prompt, params, max_tokens, stop_at_eos, draft=draft, matcher=matcher)
        first_time = None
        with closing(decode_alone(self.rows, self.method.execute, request, reuse, self._started,
                                  owner="SpeculativeDecoder", budget=budget)) as events:
            for event in events:
                if first_time is None:  # the first call that gave tokens (the prefill; a pipelined program's
                    # next call): its time, its tokens (the core applies a whole call before its first token
                    # comes out: with accepted drafts, `produced` is already past 1 at the first one)
                    first_time = time.perf_counter()
                    self.first_call = (first_time, self._row.produced)
                yield event.token

    def generate(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None, draft=None,
                 stop_at_eos: bool = True) -> tuple[list[int], float]:
        """(tokens, decode tok/s): the tokens after the first call's, over the time after it (the plain loop's
        measure: decoding after the prefill)."""
        tokens = list(self.stream(prompt_ids, max_tokens, params, draft, stop_at_eos))
        end = time.perf_counter()
        first_time, first_tokens = self.first_call
        rate = (len(tokens) - first_tokens) / (end - first_time) if len(tokens) > first_tokens else 0.0
        return tokens, rate
