"""Speculative decoding of one sequence over a draft-verifying program (`etmlx export --draft-tokens K`).

    decoder = SpeculativeDecoder("model.pte")
    tokens = list(decoder.stream(prompt_ids, 64, params, draft=NgramDraft()))
    decoder.stats   # DraftStats(calls, proposed, accepted) of the last stream

Each call feeds the row's last token and up to K drafts from the source (draft_sources.py) at the next
positions; the program returns how many drafts it accepts (n) and the next token, so a call emits n + 1
tokens. The seeds follow the plain loop's schedule (output token j draws with params.seed + j), and the
program's acceptance draws are the plain sampler's own (sampler/draft_verification.py): greedy and seeded
sampled tokens are the plain loop's tokens, whatever the source proposes. The first call (the prefill) may
carry drafts already (a prediction's first tokens). A batched program decodes the sequence in row 0, as
loop.py does; the other rows idle.

Row 0's KV cache outlives a stream, as the plain loop's rows do (row_caches.py): `stream(..., reuse=True)`
prefills only what it does not hold yet (`etmlx chat`, the Python API's prompt_cache). The record holds the
tokens each call fed and the drafts it accepted; a rejected draft's position is past the record's end, so the
next call overwrites it before any reuse could count it. Draft programs keep full-length caches (no rings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.loop import check_prompt
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.row_caches import RowCaches
from backends.mlx.llm.decoder.step_inputs import step_inputs
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


class SpeculativeDecoder(ProgramTokenizer):
    def __init__(self, pte: Path, meta: DecoderMeta | None = None, method=None):
        self.pte = Path(pte)
        if not self.pte.is_file():
            raise FileNotFoundError(f"{self.pte} does not exist")
        self.meta = meta or DecoderMeta.load(self.pte)
        if not self.meta.draft_tokens:
            raise ValueError(f"{self.pte} does not verify drafts: export it with --draft-tokens K")
        self.method = method or load_method(self.pte)
        self.meta.check_program(self.pte, self.method.input_specs(), drafts=True)
        self.stats = DraftStats()  # the last stream's calls and drafts
        self.first_call = (0.0, 0)  # (time, tokens) when the last stream's first call returned
        self.caches = RowCaches(1, self.meta.max_seq_len, ring=self.meta.ring_cache is not False)  # row 0's
        self.last_cached = 0  # prompt tokens the last stream found in row 0's cache (not prefilled)
        self._active = False

    def _call(self, tokens: list[int], drafts: list[int], start: int, params: SamplingParams, step: int):
        idle = self.meta.batch - 1
        row = tokens + drafts
        batch = torch.zeros(self.meta.batch, len(row), dtype=torch.int64)
        batch[0] = torch.tensor(row)
        inputs = step_inputs(self.meta, batch, [start] + [0] * idle, [len(row)] + [1] * idle,
                             [params] + [SamplingParams()] * idle, [step] + [0] * idle, [step == 0] + [True] * idle,
                             drafts=[drafts] + [[]] * idle)
        accepted, token = self.method.execute(inputs)
        n = int(accepted[0])
        self.stats.calls += 1
        self.stats.proposed += len(drafts)
        self.stats.accepted += n
        return drafts[:n] + [int(token[0])]

    def stream(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None, draft=None,
               stop_at_eos: bool = True, budget: DraftBudget | None = None, reuse: bool = False) -> Iterator[int]:
        """Token ids, as the plain loop (loop.py) would yield them; `draft`: a source (draft_sources.py) or None.
        `reuse`: start from the longest prefix of the prompt that row 0's cache still holds (`last_cached`)."""
        params = params or SamplingParams()
        params.check(self.meta.config, self.meta.vocab_size)
        prompt = check_prompt(self.meta, prompt_ids, max_tokens)
        budget = budget or DraftBudget(self.meta.draft_tokens)
        if self._active:  # its calls would write into the unfinished one's row
            raise RuntimeError("another generation of this SpeculativeDecoder is unfinished: exhaust or close() it "
                               "first")
        self._active = True
        try:
            yield from self._stream(prompt, max_tokens, params, draft, stop_at_eos, budget, reuse)
        finally:
            self._active = False

    def _stream(self, prompt, max_tokens, params, draft, stop_at_eos, budget, reuse) -> Iterator[int]:
        self.stats = DraftStats()  # this stream's
        self.last_cached = self.caches.reusable(0, prompt) if reuse else 0
        output: list[int] = []
        fed = prompt[self.last_cached:]  # tokens of the next call before its drafts
        while len(output) < max_tokens:
            # Room: the call emits up to k + 1 tokens, all within max_tokens (the cache then has room too).
            k = min(budget.size(), self.meta.draft_tokens, max_tokens - len(output) - 1)
            drafts = list(draft.propose(prompt, output, k))[:k] if draft is not None and k > 0 else []
            start = len(prompt) + len(output) - len(fed)
            try:
                new = self._call(fed, drafts, start, params, len(output))
            except BaseException:  # a failed call may have left the cache half written
                self.caches.forget()
                raise
            self.caches.wrote(0, start, fed + new[:-1])  # the accepted drafts; the last token is not fed yet
            if not output:
                self.first_call = (time.perf_counter(), len(new))
            budget.update(len(drafts), len(new) - 1)
            for token in new:
                output.append(token)
                yield token
                if stop_at_eos and token in self.meta.eos_token_ids:
                    return
            fed = [output[-1]]

    def generate(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None, draft=None,
                 stop_at_eos: bool = True) -> tuple[list[int], float]:
        """(tokens, decode tok/s): the tokens after the first call's, over the time after it (the plain loop's
        measure: decoding after the prefill)."""
        tokens = list(self.stream(prompt_ids, max_tokens, params, draft, stop_at_eos))
        end = time.perf_counter()
        first_time, first_tokens = self.first_call
        rate = (len(tokens) - first_tokens) / (end - first_time) if len(tokens) > first_tokens else 0.0
        return tokens, rate
