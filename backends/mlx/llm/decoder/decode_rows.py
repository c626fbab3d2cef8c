"""The decode loop's engine over the decode-step rules: the rows of a decoder program, the inputs of its next
call, and what a call's outputs mean for each row. The rules themselves live in one place, the C++ core
(runtime/decode_rows.h: positions, steps, the seed schedule, the penalty reset, pipelined programs' fed-back
token, scoring, eos / max_tokens, drafts and the prompt cache's row choice), which etmlx_decode runs too.
This module adds what only Python has: each row's request, its grammar matcher (the masks, and the check
of each token), its draft source and draft budget, and the knob layout (step_inputs.py). The Python Decoder
(loop.py: one request, a batch of one) and the server's engine (serve/engine.py: a request per row) both
drive a DecodeRows:

    rows = DecodeRows(meta)
    slot, reuse = rows.choose(prompt, usable=meta.batch)
    rows.start(slot, Sequence(prompt, params, max_tokens))
    while rows.active:
        rows.draft()  # draft-verifying programs: each row's drafts for the call
        outputs = program.execute(rows.call_inputs(masks=rows.masks()))
        for slot, request, event in rows.read(outputs):
            ...  # event.finish_reason set: the row has ended (and freed its slot)

Rows share nothing but the call: a request gets the tokens it would get alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backends.mlx.llm.decoder.constraints import ConstraintError, Matcher, fill_masks
from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.meta import ROPE_INPUT, DecoderMeta
from backends.mlx.llm.decoder.qwen2_vl import rope_positions
from backends.mlx.llm.decoder.step_inputs import step_inputs
from backends.mlx.llm.sampler.knobs import mask_words
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime import decode_rows_lib as lib
from backends.mlx.runtime.decode_rows_lib import RowsCore, default_prefill_chunk

log = logging.getLogger("etmlx.decode_rows")
# Logit bias that forces a scored token; raw logprobs are unaffected by bias.
FORCE_BIAS = 100.0


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
    # vision-language programs: the prompt's image positions and embeddings (image_encoder.PromptImages); the
    # prompt then holds image keys (>= the vocabulary) at those positions
    prompt_images: object | None = None
    adapter: int = 0  # switchable adapters: the `adapter` input's value for the row (DecoderMeta.adapter_index)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Row:
    """A running row: its request (and draft budget) here, its state read from the core; a snapshot once it
    has ended."""

    def __init__(self, core: RowsCore, slot: int, request, budget: DraftBudget | None):
        self._core, self.slot, self.request, self.budget = core, slot, request, budget
        self._final: dict | None = None
        self._output: list[int] = []
        self.last_drafts: list[int] = []  # the drafts of the row's current call

    def _freeze(self) -> None:
        """The row ended in the core: keep its final state (its slot may take another request)."""
        self._final = self._core.row(self.slot, ended=True)
        self._output = self._core.tokens(self.slot, lib.OUTPUT, ended=True) if self._core.draft_tokens else []

    def _get(self, name: str) -> int:
        state = self._final if self._final is not None else self._core.row(self.slot)
        return int(state[name])

    pos = property(lambda self: self._get("pos"))  # cache position of the next call's first token
    cached = property(lambda self: self._get("cached"))  # prompt tokens its row's cache already held
    step = property(lambda self: self._get("step"))  # the row's decode step of the next call (0 = prefill)
    produced = property(lambda self: self._get("produced"))  # tokens delivered
    calls = property(lambda self: self._get("calls"))  # program calls that fed the row, the prefill included
    proposed = property(lambda self: self._get("proposed"))  # drafts sent for verification
    accepted = property(lambda self: self._get("accepted"))  # drafts accepted

    @property
    def feed(self) -> list[int]:
        return [] if self._final is not None else self._core.tokens(self.slot, lib.FEED)

    @property
    def output(self) -> list[int]:
        """Draft-verifying programs: the tokens produced so far (what a draft source reads)."""
        return list(self._output) if self._final is not None else self._core.tokens(self.slot, lib.OUTPUT)


class _CacheRow:
    def __init__(self, core: RowsCore, slot: int):
        self._core, self._slot = core, slot

    @property
    def tokens(self) -> list[int]:
        return self._core.tokens(self._slot, lib.HELD)

    @tokens.setter
    def tokens(self, tokens: list[int]) -> None:
        self._core.set_held(self._slot, tokens)

    @property
    def used(self) -> int:
        return self._core.used(self._slot)


class RowCaches:
    """The prompt cache as the core keeps it: the token at each cache position of each row (decode_rows.h)."""

    def __init__(self, core: RowsCore, batch: int, ring: bool, enabled: bool, adapters: list[int] | None):
        self._core, self.ring, self.enabled = core, ring, enabled
        self._adapters = adapters  # DecodeRows.cache_adapters
        self.rows = [_CacheRow(core, slot) for slot in range(batch)]

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """Prompt tokens row `slot` already holds at their positions (0 when caching is off)."""
        return self._core.reusable(slot, prompt)

    def held(self, slot: int) -> list[int]:
        return self._core.tokens(slot, lib.HELD)

    def hold(self, slot: int, tokens: list[int]) -> None:
        """Row `slot`'s cache now holds `tokens` at positions 0.. (a prompt cache loaded from a file). Its
        adapter is unknown: no request reuses it on a program with switchable adapters."""
        self._core.set_held(slot, tokens)
        if self._adapters is not None:
            self._adapters[slot] = -1

    def taken(self, slot: int) -> None:
        """A request took the row now (its least-recently-used clock)."""
        self._core.taken(slot)


def checked_prefill_chunk(chunk: int) -> int:
    """`chunk` (prompt tokens per prefill call; 0: the whole prompt in one call), or a one-line ValueError. Which
    programs may prefill in chunks is the decode-step rules' to say (decode_rows.cpp start(): not those with drafts
    or proposals); image prompts are prefilled whole (DecodeRows.start). Penalty counts need nothing: each chunk
    resets them (decode_rows.cpp layout)."""
    if chunk < 0:
        raise ValueError(f"prefill_step_size must be >= 0 (0: the whole prompt in one call), not {chunk}")
    return chunk


class DecodeRows:
    def __init__(self, meta: DecoderMeta, prompt_cache: bool = True, copy_rows=None, prefill_chunk: int | None = None):
        """`copy_rows(src, dst, n)`: copies positions [0, n) of row src's KV cache into row dst inside the
        program's state (LoadedMethod.copy_rows); with it, a request reuses the longest prefix any row holds,
        busy or free (cross-row reuse), not only the one its own row holds. Never for ring programs.
        `prefill_chunk`: prompt tokens per prefill call (default decode_rows.h's 512; 0: the whole prompt in one
        call), for the programs and requests that allow it (checked_prefill_chunk)."""
        self.meta = meta
        self.prefill_chunk = checked_prefill_chunk(default_prefill_chunk() if prefill_chunk is None else prefill_chunk)
        if meta.adapters:  # another row's KV cache may come from another adapter: no cross-row copies
            copy_rows = None
        ring = meta.ring_cache is not False  # programs exported before the field may keep rings
        self.core = RowsCore(meta.batch, meta.max_seq_len, ring=ring, prompt_cache=prompt_cache,
                             pipelined=bool(meta.pipelined), draft_tokens=int(meta.draft_tokens or 0),
                             propose_tokens=int(meta.propose_tokens or 0), eos=list(meta.eos_token_ids),
                             copies=copy_rows is not None)
        self.copy_rows = copy_rows if self.core.copies else None
        self.rows: list[Row | None] = [None] * meta.batch
        # Switchable adapters: the adapter each row's cache was written with; a request on another starts afresh.
        self.cache_adapters = [0] * meta.batch
        self.caches = RowCaches(self.core, meta.batch, ring, prompt_cache,
                                self.cache_adapters if meta.adapters else None)
        # A --propose-tokens program's last call: each row's K tokens (proposer.py); the rows read column 0.
        self.proposals: list[list[int]] = []

    @property
    def active(self) -> int:
        return self.core.active

    @property
    def copies(self) -> bool:
        """Whether a request can reuse a prefix another row holds (cross-row reuse)."""
        return self.copy_rows is not None

    # ---- rows come and go ----
    def room(self) -> int:
        """Tokens a call may feed: every row of a call writes positions pos .. pos + width - 1."""
        return self.core.room()

    def choose(self, prompt: list[int], usable: int, reuse: bool = True) -> tuple[int | None, int]:
        """(slot, prompt tokens it already holds) for a new request among the first `usable` slots;
        (None, 0) when none is free. Without `reuse`, the least recently used free slot."""
        return self.core.choose(prompt, usable, reuse)

    def busy_prefix(self, prompt: list[int]) -> tuple[int | None, int, int]:
        """(slot, n, steps): the running row whose prompt shares the longest prefix (n tokens) with
        `prompt`, and the steps it has left at most (with cross-row reuse: its prefill calls, at least 1);
        (None, 0, 0) with none, with caching off, or for ring programs."""
        return self.core.busy_prefix(prompt)

    def start(self, slot: int, request, reuse: bool = True, budget: DraftBudget | None = None) -> Row:
        """Row `slot` takes `request` (its prompt checked: loop.check_prompt); with `reuse`, from the
        longest prefix the slot's cache (or, with cross-row reuse, another row's) holds. `budget`: a
        draft-verifying program's drafts per call for the row (default: a DraftBudget of up to K).
        A request on another adapter than the one the slot's cache was written with reuses none of it."""
        adapter = getattr(request, "adapter", 0)
        if adapter != self.cache_adapters[slot]:
            self.core.set_held(slot, [])
            self.cache_adapters[slot] = adapter
        self.core.start(slot, list(request.prompt), request.max_tokens, request.stop_at_eos, request.forced,
                        request.params.seed, request.matcher is not None, reuse,
                        copy=self._copy if self.copy_rows is not None else None,
                        prefill_chunk=0 if getattr(request, "prompt_images", None) is not None else self.prefill_chunk)
        if not self.meta.draft_tokens:
            budget = None
        elif budget is None:
            budget = DraftBudget(self.meta.draft_tokens)
        row = Row(self.core, slot, request, budget)
        self.rows[slot] = row
        return row

    def _copy(self, source: int, slot: int, n: int) -> bool:
        try:
            self.copy_rows(source, slot, n)
            return True
        except Exception as exc:  # noqa: BLE001 - the request still runs, prefilling its whole prompt
            log.warning("copying %d cached positions from row %d to row %d failed: %s", n, source, slot, exc)
            return False

    def end(self, slot: int) -> Row:
        """Free the slot; its cache keeps what the row wrote."""
        row = self.rows[slot]
        self.core.end(slot)
        self.rows[slot] = None
        if row is not None:
            row._freeze()
        return row

    def place(self, slot: int, pos: int, step: int) -> None:
        """Row `slot`'s next call at an explicit cache position and step (a caller's own loop)."""
        self.core.place(slot, pos, step)

    def forget(self) -> None:
        """The program lost its state (a failed call, a restarted worker): no row's cache is reusable."""
        self.core.forget()

    # ---- one call ----
    def draft(self) -> None:
        """Draft-verifying programs: ask each row's source for its next call's drafts (no-op otherwise), as
        many as its budget asks for and the call has room for (the core's draft_room)."""
        if not self.meta.draft_tokens:
            return
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            drafts, source = [], row.request.draft
            if source is not None:
                # 0 while the row's last token is in flight (a pipelined draft program; decode_rows.h).
                k = self.core.ask(slot, row.budget.size())
                if k > 0:
                    drafts = [int(t) for t in source.propose(list(row.request.prompt), row.output, k)][:k]
                if drafts and row.request.matcher is not None:  # no mask exists past a draft the grammar rejects
                    drafts = drafts[:row.request.matcher.valid_prefix(drafts)]
            self.core.set_drafts(slot, drafts)
            row.last_drafts = drafts

    def masks(self):
        """The allowed-token masks of the next call, or None when no row is constrained; raises
        ConstraintError when a grammar is in an error state. A draft-verifying program's: per row, one mask per
        verified position (call draft() first)."""
        matchers = [row.request.matcher if row is not None else None for row in self.rows]
        if all(m is None for m in matchers):
            return None
        if self.meta.draft_tokens:  # a mask per verified position: before the row's drafts, and after each
            return [m.masks_along(row.last_drafts) if m is not None else None for m, row in zip(matchers, self.rows)]
        return fill_masks(matchers, mask_words(self.meta.vocab_size))

    def constrained(self) -> list[int]:
        return [slot for slot, row in enumerate(self.rows) if row is not None and row.request.matcher is not None]

    def call_inputs(self, only: int | None = None, masks=None) -> list[torch.Tensor]:
        """The program inputs of the next call; `only`: that row alone (the others idle), to find which
        row a value that cannot be laid out belongs to."""
        tokens, per_row = self.core.layout(only)
        params, drafts, adapters = [], [], []
        for slot, kind in enumerate(per_row["kinds"]):
            row = self.rows[slot]
            adapters.append(getattr(row.request, "adapter", 0) if kind != lib.IDLE and row is not None else 0)
            if kind == lib.REQUEST:
                params.append(row.request.params)
            elif kind == lib.FORCED:  # greedy with the step's scored token pushed to the top
                params.append(SamplingParams(logit_bias={per_row["forced"][slot]: FORCE_BIAS}))
            else:  # an idle row's throwaway token, or a pipelined scored row's extra step: greedy
                params.append(SamplingParams())
            drafts.append(row.last_drafts if kind != lib.IDLE and row is not None else [])
        tokens = torch.tensor(tokens, dtype=torch.int64)
        image_embeds = None
        if self.meta.takes_images:  # image keys back to the image token; each row's image embeddings
            tokens = torch.where(tokens >= self.meta.vocab_size, self.meta.image_token_id, tokens)
            image_embeds = torch.zeros(*tokens.shape, self.meta.image_embed_dim)
            for slot, kind in enumerate(per_row["kinds"]):
                row = self.rows[slot]
                if kind == lib.REQUEST and getattr(row.request, "prompt_images", None) is not None:
                    row.request.prompt_images.fill(image_embeds, slot, int(per_row["start_pos"][slot]))
        rope = None
        if ROPE_INPUT in self.meta.inputs:  # multimodal RoPE: each row's positions from its image positions
            rope = torch.stack([rope_positions(getattr(row.request, "prompt_images", None) if row is not None else None,
                                               self.meta.image_tokens, int(per_row["start_pos"][slot]), tokens.shape[1])
                                for slot, row in enumerate(self.rows)])
        return step_inputs(self.meta, tokens, per_row["start_pos"],
                           per_row["lengths"], params, per_row["seeds"], [bool(f) for f in per_row["first"]],
                           masks=masks, drafts=drafts if self.meta.draft_tokens else None,
                           deliver=bool(per_row["deliver"][0]), image_embeds=image_embeds,
                           adapters=adapters, rope_positions=rope)

    def read(self, outputs) -> list[tuple[int, object, TokenEvent]]:
        """Apply a call's outputs: (slot, request, event) for each row that got a token or failed, in
        slot order. A row whose event has a finish_reason has ended and freed its slot."""
        meta = self.meta
        results = accepted = None
        fed = None
        if meta.draft_tokens:  # outputs (accepted [B], token [B]), and fed [B] when pipelined
            accepted, tokens = [int(n) for n in outputs[0].tolist()], outputs[1].tolist()
            fed = outputs[2].tolist() if meta.pipelined else None
            for slot, row in enumerate(self.rows):
                if row is not None:
                    row.budget.update(len(row.last_drafts), accepted[slot])  # clamped into [0, drafts] there
        else:
            results = _Results(outputs, meta.config.logprobs)
            tokens = results.tokens
            if meta.propose_tokens:  # tokens [B, K] (proposer.py): column 0 is the plain token
                self.proposals = tokens
                tokens = results.tokens = [row[0] for row in tokens]
        constrained = any(row is not None and row.request.matcher is not None for row in self.rows)
        raw = self.core.read(tokens, accepted, self._advance if constrained else None, fed=fed)
        events = []
        for e in raw:
            slot, row = e["slot"], self.rows[e["slot"]]
            event = results.event(slot) if results is not None else TokenEvent(e["token"])
            event.token, event.cached_tokens = e["token"], e["cached"]
            if meta.draft_tokens:
                event.drafts_proposed, event.drafts_accepted = e["proposed"], e["accepted"]
            event.finish_reason = lib.FINISH[e["finish"]]
            if e["failure"]:
                event.error = self.core.failure_message(e["failure"], e["detail"])
                event.cause = "grammar" if e["failure"] in (lib.NO_TOKEN, lib.GRAMMAR) else None
                event.token = event.logprob = event.top = None
            events.append((slot, row.request, event))
            if event.finish_reason and self.rows[slot] is row:  # the core ended the row
                self.rows[slot] = None
                row._freeze()
        return events

    def _advance(self, slot: int, token: int) -> bool:
        """A constrained row's matcher takes the token; False when its grammar rejects it."""
        matcher = self.rows[slot].request.matcher
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

    def event(self, slot: int) -> TokenEvent:
        event = TokenEvent(int(self.tokens[slot]))
        if self.logprobs is not None:
            event.logprob = float(self.logprobs[slot])
            event.top = list(zip(self.top_ids[slot], self.top_lps[slot]))
        return event
