"""The decode-step rules, in one place: the rows of a decoder program, the inputs of its next call,
and what a call's outputs mean for each row. The Python Decoder (loop.py: one request, a batch of
one) and the server's engine (serve/engine.py: a request per row) both drive a DecodeRows:

    rows = DecodeRows(meta)
    slot, reuse = rows.choose(prompt, usable=meta.batch)
    rows.start(slot, Sequence(prompt, params, max_tokens))
    while rows.active:
        outputs = program.execute(rows.call_inputs(masks=rows.masks()))
        for slot, request, event in rows.read(outputs):
            ...  # event.finish_reason set: the row has ended (and freed its slot)

The rules:
- Step 0 of a row prefills its prompt (only the part its row's cache does not already hold:
  row_caches.py) in one call; step k > 0 feeds the previous token at the next position.
- Seeded programs draw with seed = params.seed + step, so a generation is reproducible from one base
  seed; step 0 also resets the row's penalty state (penalty counts are never seeded from the prompt,
  so a reused prefix changes neither).
- Pipelined programs (pipelined.py) get the same calls, except that step k > 0 feeds FED_BACK (the
  token the device sampled for the row) and each call returns the previous call's results: a row's
  prefill returns nothing of its own, and its first token arrives with step 1.
- Structured output: a row's matcher gives its next call's mask and advances on each token.
- Scoring (`forced`): step k is greedy with forced[k] pushed up by FORCE_BIAS; a mismatch fails the row.
- A row with no request writes a throwaway token where nothing cached depends on it (row_caches.py).
- Rows share nothing but the call: each has its own position, step, seed, penalty reset and mask, so
  a request gets the tokens it would get alone.
- Draft-verifying programs (`--draft-tokens K`, per row; speculative.py drives one sequence through these
  rules, the server a request per row): before every call, the prefill included, `draft()`
  asks each row's source (draft_sources.py) for up to k drafts (k from the row's DraftBudget, at most
  K, the row's tokens left minus one and the call's room), fed after the row's tokens; the call returns how
  many it accepted (n) and the next token, so the row gets n + 1 tokens (each checked for eos / max_tokens),
  advances n + 1 steps (seed + step stays the plain schedule) and n + 1 positions past its fed tokens. A
  rejected draft's KV entry is overwritten by the next call before anything attends to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backends.mlx.llm.decoder.constraints import ConstraintError, Matcher, fill_masks
from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.meta import FED_BACK, DecoderMeta
from backends.mlx.llm.decoder.row_caches import RowCaches, common_prefix
from backends.mlx.llm.decoder.step_inputs import step_inputs
from backends.mlx.llm.sampler.knobs import mask_words
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.llm.sampler.processing import NO_ALLOWED_TOKEN

log = logging.getLogger("etmlx.decode_rows")
# Logit bias that forces a scored token; raw logprobs are unaffected by bias.
FORCE_BIAS = 100.0
NO_TOKEN_ERROR = "the grammar allows no token the model can produce here (every allowed token has probability 0)"


@dataclass
class TokenEvent:
    """One sampled token of a request, or its end. finish_reason: None while running, then "stop"
    (end-of-sequence token), "length", or (set by a driver) "cancelled", "abort", "error"."""

    token: int | None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    finish_reason: str | None = None
    error: str | None = None
    cause: str | None = None  # "grammar": the error is the request's grammar failing (a client error, not ours)
    cached_tokens: int = 0  # prompt tokens its row's cache already held (not prefilled)
    # Draft-verifying programs: the row's drafts sent for verification so far, and how many were accepted.
    drafts_proposed: int = 0
    drafts_accepted: int = 0


@dataclass
class Sequence:
    """What the rules read of a request (the server's EngineRequest has the same fields)."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_at_eos: bool = True
    forced: list[int] | None = None  # scoring: the tokens to force, one per step
    matcher: Matcher | None = None  # structured output: the grammar state
    draft: object | None = None  # draft-verifying programs: the row's draft source (draft_sources.py), or None


@dataclass
class Row:
    request: object  # a Sequence, or anything with its fields
    feed: list[int]  # tokens of the next call ([FED_BACK] when a pipelined program decodes)
    pos: int  # cache position of feed[0]
    cached: int = 0  # prompt tokens its row's cache already held (not prefilled)
    step: int = 0  # the row's decode step of the next call (0 = prefill): seed = params.seed + step
    produced: int = 0  # tokens delivered; a pipelined row's step runs one ahead of them
    calls: int = 0  # program calls that fed the row, the prefill included
    # Draft-verifying programs only:
    drafts: list[int] | None = None  # the next call's drafts, fed after `feed`
    output: list[int] | None = None  # the tokens produced so far (what a draft source reads)
    budget: DraftBudget | None = None
    proposed: int = 0
    accepted: int = 0


class DecodeRows:
    def __init__(self, meta: DecoderMeta, prompt_cache: bool = True, copy_rows=None):
        """`copy_rows(src, dst, n)`: copies positions [0, n) of row src's KV cache into row dst inside the
        program's state (LoadedMethod.copy_rows); with it, a request reuses the longest prefix any row holds,
        busy or free (cross-row reuse), not only the one its own row holds. Never for ring programs."""
        self.meta = meta
        self.rows: list[Row | None] = [None] * meta.batch
        self.caches = RowCaches(meta.batch, meta.max_seq_len, ring=meta.ring_cache is not False,
                                enabled=prompt_cache)
        self.copy_rows = copy_rows if prompt_cache and not self.caches.ring else None
        self.active = 0

    @property
    def copies(self) -> bool:
        """Whether a request can reuse a prefix another row holds (cross-row reuse)."""
        return self.copy_rows is not None

    def _copyable(self, slot: int, prompt: list[int]) -> tuple[int | None, int]:
        """(row, n): the row other than `slot`, busy or free, whose cache holds the longest reusable prefix of
        `prompt` (n tokens); (None, 0) without cross-row reuse. A busy row's positions before its next call's
        never change while it runs, and a copy is ordered after every call before it (it builds on the state)."""
        if not self.copies:
            return None, 0
        best = (None, 0)
        for other in range(len(self.rows)):
            if other != slot:
                n = self.caches.reusable(other, prompt)
                if n > best[1]:
                    best = (other, n)
        return best

    # ---- rows come and go ----
    def room(self) -> int:
        """Tokens a call may feed: every row of a call writes positions pos .. pos + width - 1."""
        return min((self.meta.max_seq_len - row.pos for row in self.rows if row is not None),
                   default=self.meta.max_seq_len)

    def choose(self, prompt: list[int], usable: int, reuse: bool = True) -> tuple[int | None, int]:
        """(slot, prompt tokens it already holds) for a new request among the first `usable` slots;
        (None, 0) when none is free. Without `reuse`, the least recently used free slot."""
        free = [slot for slot in range(usable) if self.rows[slot] is None]
        if not free:
            return None, 0
        if not reuse:
            return min(free, key=lambda slot: self.caches.rows[slot].used), 0
        slot, n = self.caches.choose(prompt, free)
        return slot, max(n, self._copyable(slot, prompt)[1])

    def busy_prefix(self, prompt: list[int]) -> tuple[int | None, int, int]:
        """(slot, n, steps): the running row whose prompt shares the longest prefix (n tokens) with
        `prompt`, and the steps it has left at most; the row's cache will hold that prefix when it ends.
        With cross-row reuse the prefix can be copied as soon as the row has prefilled it: steps is then 1
        (its prefill call; a row that has prefilled it already is what choose() reuses).
        (None, 0, 0) with none, with caching off, or for ring programs (a ring row is reused only where
        positions continue, which depends on the tokens it has yet to write)."""
        if not self.caches.enabled or self.caches.ring:
            return None, 0, 0
        best = (None, 0, 0)
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            n = min(common_prefix(row.request.prompt, prompt), len(prompt) - 1)
            if n > best[1]:
                steps = 1 if self.copies else row.request.max_tokens - row.produced + (1 if row.step == 0 else 0)
                best = (slot, n, steps)
        return best

    def start(self, slot: int, request, reuse: bool = True, budget: DraftBudget | None = None) -> Row:
        """Row `slot` takes `request` (its prompt checked: loop.check_prompt); with `reuse`, from the
        longest prefix the slot's cache holds. `budget`: a draft-verifying program's drafts per call for
        the row (default: a DraftBudget of up to K)."""
        prompt = list(request.prompt)
        n = self.caches.reusable(slot, prompt) if reuse else 0
        source, copyable = self._copyable(slot, prompt) if reuse else (None, 0)
        if copyable > n:
            n = self._copy(source, slot, prompt[:copyable])
        row = Row(request, feed=prompt[n:], pos=n, cached=n)
        if self.meta.draft_tokens:
            row.drafts, row.output = [], []
            row.budget = budget if budget is not None else DraftBudget(self.meta.draft_tokens)
        self.rows[slot] = row
        self.caches.taken(slot)
        self.active += 1
        return row

    def _copy(self, source: int, slot: int, prefix: list[int]) -> int:
        """Row `slot` takes `prefix` from row `source`'s cache; the tokens it now holds from the prompt (0 when
        the copy failed: a state that lost it fails the next call, which forgets every row)."""
        self.caches.rows[slot].tokens = []  # overwritten from here on, whatever happens
        try:
            self.copy_rows(source, slot, len(prefix))
        except Exception as exc:  # noqa: BLE001 - the request still runs, prefilling its whole prompt
            log.warning("copying %d cached positions from row %d to row %d failed: %s", len(prefix), source, slot,
                        exc)
            return 0
        self.caches.wrote(slot, 0, prefix)
        return len(prefix)

    def end(self, slot: int) -> Row:
        """Free the slot; its cache keeps what the row wrote."""
        row = self.rows[slot]
        self.rows[slot] = None
        self.active -= 1
        return row

    def forget(self) -> None:
        """The program lost its state (a failed call, a restarted worker): no row's cache is reusable."""
        self.caches.forget()

    # ---- one call ----
    def draft(self) -> None:
        """Draft-verifying programs: ask each row's source for its next call's drafts (no-op otherwise).
        A call's rows all write `width` positions, so a row's tokens plus drafts stay within the call's room."""
        if not self.meta.draft_tokens:
            return
        room = self.room()
        for row in self.rows:
            if row is None:
                continue
            row.drafts = []
            source = row.request.draft
            if source is None:
                continue
            k = min(row.budget.size(), self.meta.draft_tokens, row.request.max_tokens - row.produced - 1,
                    room - len(row.feed))
            if k > 0:
                row.drafts = [int(t) for t in source.propose(list(row.request.prompt), row.output, k)][:k]

    def masks(self):
        """The allowed-token masks of the next call, or None when no row is constrained; raises
        ConstraintError when a grammar is in an error state."""
        matchers = [row.request.matcher if row is not None else None for row in self.rows]
        if all(m is None for m in matchers):
            return None
        return fill_masks(matchers, mask_words(self.meta.vocab_size))

    def constrained(self) -> list[int]:
        return [slot for slot, row in enumerate(self.rows) if row is not None and row.request.matcher is not None]

    def call_inputs(self, only: int | None = None, masks=None) -> list[torch.Tensor]:
        """The program inputs of the next call; `only`: that row alone (the others idle), to find which
        row a value that cannot be laid out belongs to."""
        meta = self.meta
        rows = [row if only is None or slot == only else None for slot, row in enumerate(self.rows)]
        fed = [None if row is None else row.feed + (row.drafts or []) for row in rows]
        width = max((len(f) for f in fed if f is not None), default=1)
        tokens = torch.zeros(meta.batch, width, dtype=torch.int64)
        starts, lengths, params, steps, resets, drafts = [], [], [], [], [], []
        for slot, row in enumerate(rows):
            if row is None:  # a throwaway token, greedy, where it overwrites nothing cached
                starts.append(self.caches.idle_position(slot, width)), lengths.append(1)
                params.append(SamplingParams()), steps.append(0), resets.append(True), drafts.append([])
                continue
            tokens[slot, :len(fed[slot])] = torch.tensor(fed[slot], dtype=torch.int64)
            starts.append(row.pos), lengths.append(len(fed[slot])), steps.append(row.step)
            resets.append(row.step == 0), drafts.append(row.drafts or [])
            params.append(self.params(row))
        return step_inputs(meta, tokens, starts, lengths, params, steps, resets, masks=masks,
                           drafts=drafts if meta.draft_tokens else None)

    @staticmethod
    def params(row: Row) -> SamplingParams:
        forced = row.request.forced
        if forced is None:
            return row.request.params
        if row.step < len(forced):  # greedy with the step's scored token pushed to the top
            return SamplingParams(logit_bias={forced[row.step]: FORCE_BIAS})
        return SamplingParams()  # a pipelined row's extra step past its last token: dropped

    def read(self, outputs) -> list[tuple[int, object, TokenEvent]]:
        """Apply a call's outputs: (slot, request, event) for each row that got a token or failed, in
        slot order. A row whose event has a finish_reason has ended and freed its slot."""
        meta = self.meta
        for row in self.rows:
            if row is not None:
                row.calls += 1
        if meta.draft_tokens:
            return self._read_drafts(outputs)
        results = _Results(outputs, meta.config.logprobs)
        events = []
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            # A pipelined row's prefill returns nothing of its own (the outputs are the slot's previous call's);
            # its decode calls feed the device's token, which is the one this call returns.
            has_result = not (meta.pipelined and row.step == 0)
            event = results.event(slot) if has_result else None
            written = [event.token] if row.feed == [FED_BACK] else row.feed
            self.caches.wrote(slot, row.pos, written)
            if event is not None:
                event.cached_tokens = row.cached
                self._check(row, event)
                events.append((slot, row.request, event))
                if event.finish_reason:
                    self.end(slot)
                    continue
            row.pos += len(row.feed)
            row.feed = [FED_BACK if meta.pipelined else results.token(slot)]
            row.step += 1
        return events

    def _read_drafts(self, outputs) -> list[tuple[int, object, TokenEvent]]:
        """read() for a draft-verifying program: outputs (accepted [B], token [B]); a row gets its accepted drafts
        and the call's token, one event each, until one of them ends it."""
        accepted, tokens = outputs[0].tolist(), outputs[1].tolist()
        events = []
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            n, drafts = int(accepted[slot]), row.drafts or []
            new = drafts[:n] + [int(tokens[slot])]
            self.caches.wrote(slot, row.pos, row.feed + drafts[:n])  # not the rejected drafts: stale entries
            row.proposed += len(drafts)
            row.accepted += n
            row.budget.update(len(drafts), n)
            for token in new:
                event = TokenEvent(token, cached_tokens=row.cached, drafts_proposed=row.proposed,
                                   drafts_accepted=row.accepted)
                self._check(row, event)
                events.append((slot, row.request, event))
                if event.finish_reason:
                    self.end(slot)
                    break
            else:
                row.pos += len(row.feed) + n
                row.output += new
                row.feed, row.drafts = [new[-1]], []
                row.step += len(new)  # output token j draws with seed + j, as in the plain loop
        return events

    def _check(self, row: Row, event: TokenEvent) -> None:
        """Check the row's token; set finish_reason (and error) when it ends the row."""
        request, token = row.request, event.token
        if request.forced is not None and token != request.forced[row.produced]:
            event.finish_reason, event.error = "error", f"could not force token {request.forced[row.produced]}"
        elif token == NO_ALLOWED_TOKEN:
            event.finish_reason, event.error, event.cause = "error", NO_TOKEN_ERROR, "grammar"
        elif request.matcher is not None and not _advance(request.matcher, token):
            event.finish_reason, event.error, event.cause = "error", f"the grammar rejected token {token}", "grammar"
        if event.error:
            event.token = event.logprob = event.top = None
            return
        row.produced += 1
        if request.stop_at_eos and token in self.meta.eos_token_ids:
            event.finish_reason = "stop"
        elif row.produced >= request.max_tokens:
            event.finish_reason = "length"


def _advance(matcher: Matcher, token: int) -> bool:
    try:
        matcher.advance(token)
        return True
    except ConstraintError:
        return False


class _Results:
    """One call's outputs, per row: the sampled token, and its logprobs when the program has them."""

    def __init__(self, outputs, logprobs: int):
        self.tokens = outputs[0].tolist()
        self.logprobs = outputs[1].tolist() if logprobs else None
        self.top_ids = outputs[2].tolist() if logprobs else None
        self.top_lps = outputs[3].tolist() if logprobs else None

    def token(self, slot: int) -> int:
        return int(self.tokens[slot])

    def event(self, slot: int) -> TokenEvent:
        event = TokenEvent(self.token(slot))
        if self.logprobs is not None:
            event.logprob = float(self.logprobs[slot])
            event.top = list(zip(self.top_ids[slot], self.top_lps[slot]))
        return event
