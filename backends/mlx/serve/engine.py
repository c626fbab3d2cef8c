"""The engine thread: owns the program and runs the batched decode loop.

Each slot of the exported batch is a row. A request waits until a slot is free, then joins at the
next call: its prompt is prefilled in the same call in which the other rows decode one token (the
call's length is the longest row's; shorter rows pad, which the cache allows). The step rules (seed
schedule, penalty reset, pipelined programs' fed-back token, masks, scoring) are DecodeRows'
(llm/decoder/decode_rows.py), which the Python Decoder runs too: a request gets the tokens it would
get alone. A pipelined row's first token arrives one call after its prefill; when it ends, that one
extra step is dropped (its last call was at position len(prompt) + max_tokens - 1 < max_seq_len).

Draft-verifying programs (`etmlx export --draft-tokens K`): each row drafts from its own source
(`EngineRequest.draft`: a PredictionDraft for an OpenAI `prediction`, else prompt lookup, NgramDraft) and a
call may give a row several tokens (DecodeRows.draft / read); the tokens are still the plain program's.
Structured output is refused for them (the export refuses the mask).

Prompt cache (runtime/decode_rows.h): a row's KV cache outlives its request; a new request takes
the free row holding the longest prefix of its prompt (else the least recently used one) and
prefills only the rest. `EngineRequest.cached_tokens` says how many prompt tokens it reused. Where the
program can copy KV entries between rows (a loaded method or worker with state access), the prefix may
come from any row, busy or free: it is copied into the chosen row (cross-row reuse), and a request
sharing a long prefix with a row that has not prefilled it yet waits that one call. Otherwise rows share
no entries, so such a request may wait for that row to end instead of prefilling the prefix again
elsewhere (prefix affinity, in _admit).

Hand-off: other threads call `submit` / `cancel` (a queue.Queue into this thread); results go out
through each request's `sink`, called on this thread (the server wraps it in
loop.call_soon_threadsafe). A cancelled or finished row is freed before the next call.

Failures stay as small as they can: a value that cannot be laid out fails only its row; a program
call that fails fails the rows of that call; a program with `recover()` (serve/supervisor.py) is
then brought back up, and when it cannot be the engine stops (`fatal`, `on_fatal`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError, Matcher, ProgramGrammar
from backends.mlx.llm.decoder.decode_rows import FORCE_BIAS, DecodeRows, TokenEvent  # noqa: F401 (re-exported)
from backends.mlx.llm.decoder.draft_sources import NgramDraft
from backends.mlx.llm.decoder.image_encoder import ImageEncoder, plain_ids
from backends.mlx.llm.decoder.image_prompt import expand_images
from backends.mlx.llm.decoder.loop import check_prompt
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.params import SamplingParams

log = logging.getLogger("etmlx.serve")
_ids = itertools.count(1)
# Prefix affinity (see _admit): rows share no KV entries, so a request whose prompt shares a long prefix
# with a running row's may do better to wait for that row than to prefill the prefix on a free one. It
# waits when the prefill it saves outweighs the steps it waits, a decode step costing about as much as
# STEP_COST_TOKENS prompt tokens of prefill (an estimate: prefill runs many tokens per matrix product),
# and only for at least AFFINITY_MIN_TOKENS saved: short prefixes are cheaper to recompute than to queue for.
STEP_COST_TOKENS = 16
AFFINITY_MIN_TOKENS = 128


class QueueFull(RuntimeError):
    """Admission control: more requests wait for a row than the engine's max_queue."""


@dataclass
class EngineRequest:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Callable[[TokenEvent], None]  # called on the engine thread; must not block
    stop_at_eos: bool = True
    # Scoring: force these tokens one per step (greedy + bias); the events carry their raw logprobs.
    forced: list[int] | None = None
    # Structured output: the grammar the row's tokens must match; Engine.check compiles it into `matcher`.
    constraint: Constraint | None = None
    matcher: Matcher | None = None
    deadline: float | None = None  # time.monotonic() by which it must finish; None: the engine's default
    id: int = field(default_factory=lambda: next(_ids))
    cached_tokens: int = 0  # prompt tokens its row's cache already held (set when it gets a row)
    # Draft-verifying programs: the row's draft source (draft_sources.py); None: prompt lookup (set by check).
    # Ignored by plain programs.
    draft: object | None = None
    # Vision-language programs: the prompt's images (PIL, RGB, checked by serve/image_parts.py), in prompt order;
    # check encodes them into prompt_images and keys the prompt's image positions by their content
    # (llm/decoder/image_encoder.py), so the prompt cache reuses a prefix only where the same image sat.
    images: list = field(default_factory=list)
    prompt_images: object | None = None
    # Switchable adapters: the row's `adapter` input (DecoderMeta.adapter_index); 0, the base model.
    adapter: int = 0


class Engine(ProgramGrammar):
    def __init__(self, program, meta: DecoderMeta, max_batch: int | None = None,
                 request_timeout: float | None = None, max_queue: int | None = None, pte=None,
                 prompt_cache: bool = True, prefix_affinity: bool = True,
                 step_cost_tokens: float = STEP_COST_TOKENS, prefill_step_size: int | None = None):
        """program: anything with execute(inputs) -> outputs (a loaded method, a ProgramWorker or a
        SupervisedProgram). request_timeout: seconds a request may take from submission (None: no limit).
        max_queue: requests that may wait for a row (default 8 x the rows); beyond it submit raises QueueFull.
        pte: the program's file, where structured output reads the tokenizer from.
        prompt_cache: reuse what a row's cache holds from earlier requests (runtime/decode_rows.h).
        prefix_affinity: let a request wait for a running row that will hold a long prefix of its prompt.
        step_cost_tokens: prefill tokens one decode step is worth in that choice (0: always wait).
        prefill_step_size: prompt tokens per prefill call (None: 512; 0: a prompt in one call; decode_rows.py):
        a long prompt then shares calls with the other rows' decode steps instead of stalling them."""
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                      or not 1 <= max_batch <= meta.batch):
            raise ValueError(f"max_batch must be an int in [1, {meta.batch}] (the program's batch), got {max_batch!r}")
        self.program = program
        self.meta = meta
        self.pte = pte
        self._vocabulary = None  # llguidance's view of the tokenizer, built on the first constrained request
        self.images: ImageEncoder | None = None  # a vision-language program's, loaded on the first image
        # cross-row reuse where the program can copy a row's KV entries into another (decode_rows.py)
        copy_rows = program.copy_rows if getattr(program, "can_copy_rows", False) else None
        self.core = DecodeRows(meta, prompt_cache=prompt_cache, copy_rows=copy_rows, prefill_chunk=prefill_step_size)
        self.prefix_affinity = prefix_affinity
        self.step_cost_tokens = step_cost_tokens
        self.usable = max_batch or meta.batch
        self.request_timeout = request_timeout
        self.max_queue = max_queue or 8 * self.usable
        self._queued = 0  # submitted, not yet in a row or gone; other threads add, this one takes away
        self._queued_lock = threading.Lock()
        self.fatal: str | None = None  # why the engine stopped for good, if it did
        self.on_fatal: Callable[[], None] | None = None  # called on the engine thread when it does
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[EngineRequest] = deque()
        self._thread = threading.Thread(target=self._run, name="etmlx-engine", daemon=True)
        # Read by /health from other threads: plain ints, written only here.
        self.steps = 0
        self.tokens = 0
        self.waiting = 0
        self.running = False

    @property
    def rows(self):
        return self.core.rows

    @property
    def active_rows(self) -> int:
        return self.core.active

    # ---- other threads ----
    def start(self) -> "Engine":
        self.running = True
        self._thread.start()
        return self

    def check(self, request: EngineRequest) -> None:
        """Raise ValueError/TypeError for a request the program cannot run (before it is queued)."""
        request.params.check(self.meta.config, self.meta.vocab_size)
        keyed = request.prompt_images is not None  # checked before: its image positions carry keys
        check_prompt(self.meta, plain_ids(self.meta, request.prompt) if keyed else request.prompt, request.max_tokens)
        if request.images and not keyed:
            request.prompt, request.prompt_images = self._encode(request.prompt, request.images)
            check_prompt(self.meta, plain_ids(self.meta, request.prompt), request.max_tokens)  # images expanded
        elif self.meta.takes_images and not keyed and self.meta.image_token_id in request.prompt:
            raise ValueError("the prompt has image positions but no images were given")
        if request.forced is not None:
            config = self.meta.config
            if not config.logprobs or config.logprobs_mode != "raw" or config.logit_bias < 1:
                raise ValueError("scoring is not available for this .pte: it needs raw logprobs and logit bias "
                                 "(export with --logprobs N and --sampler logit-bias=N)")
            if len(request.forced) != request.max_tokens:
                raise ValueError("forced tokens and max_tokens disagree")
        if self.meta.draft_tokens:
            if request.draft is None:
                request.draft = NgramDraft()
        if request.constraint is not None and request.matcher is None:
            # ConstraintError (a ValueError) names a bad schema/regex/grammar, a program without the mask or a
            # pipelined one (ProgramGrammar.vocabulary)
            request.matcher = self.matcher(request.constraint)

    def _encode(self, prompt: list[int], images: list):
        """(keyed prompt, PromptImages): the images through the program's vision method, in this process, kept by
        content (a repeated image is not encoded again)."""
        if not self.meta.takes_images:
            raise ValueError("this program takes no images: it was exported from a text-only model")
        if self.images is None:
            if self.pte is None:
                raise ValueError("images need the program's file (Engine(pte=...)) to load its vision method")
            self.images = ImageEncoder(self.pte, self.meta)
        if prompt.count(self.meta.image_token_id) == len(images):  # one placeholder per image (an LMTP client's)
            prompt = expand_images(self.meta, prompt, list(images))
        with self.images.lock:
            return self.images.prompt(prompt, list(images))

    def submit(self, request: EngineRequest) -> int:
        self.submit_all([request])
        return request.id

    def submit_all(self, requests: list[EngineRequest]) -> None:
        """Queue all of them or none (QueueFull when they would not fit in max_queue)."""
        for request in requests:
            self.check(request)
        if not self.running:
            raise RuntimeError("the engine is not running")
        with self._queued_lock:
            if self._queued + len(requests) > self.max_queue:
                raise QueueFull(f"the server is busy: {self._queued} requests are waiting (limit {self.max_queue}); "
                                "retry later")
            self._queued += len(requests)
        for request in requests:
            if request.deadline is None and self.request_timeout is not None:
                request.deadline = time.monotonic() + self.request_timeout
            self._inbox.put(("add", request))

    def _unqueue(self, count: int = 1) -> None:
        with self._queued_lock:
            self._queued -= count

    def cancel(self, request_id: int) -> None:
        """Free the request's row before the next call (no-op once it finished)."""
        self._inbox.put(("cancel", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight (each request gets a final "abort" event) and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout)
        self.running = False

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            while self._drain():
                self._keep_program_up()
                self._expire()
                self._admit()
                if self.active_rows:
                    self._step()
        except Exception as exc:  # never die silently: end every request with the error
            log.exception("engine loop failed")
            self.fatal = f"the engine stopped: {exc}"
            self._end_all("error", self.fatal)
        finally:
            self.running = False
        if self.fatal and self.on_fatal is not None:
            self.on_fatal()

    def _keep_program_up(self) -> None:
        """Restart a program that lost its worker (raises when it cannot be restarted). The running rows'
        state lived in the worker (their caches; a pipelined program's pending tokens): they end with an
        error, as when a call fails, also when the worker died between calls."""
        recover = getattr(self.program, "recover", None)
        if recover is None:
            return
        if not getattr(self.program, "up", True):
            self._fail_rows("the program worker exited between steps")
        recover()

    def _fail_rows(self, error: str) -> None:
        self.core.forget()  # the program's state is unknown (or gone with its worker)
        for slot, row in enumerate(self.rows):
            if row is not None:
                self._free(slot, TokenEvent(None, finish_reason="error", error=error))

    def _expire(self) -> None:
        now = time.monotonic()
        late = TokenEvent(None, finish_reason="error", error="the request ran past its deadline")
        for request in [r for r in self._waiting if r.deadline is not None and r.deadline <= now]:
            self._waiting.remove(request)
            self._unqueue()
            self._emit(request, late)
        for slot, row in enumerate(self.rows):
            if row is not None and row.request.deadline is not None and row.request.deadline <= now:
                self._free(slot, late)
        self.waiting = len(self._waiting)

    def _drain(self) -> bool:
        """Apply queued submissions and cancellations; False when asked to stop."""
        idle = not self.active_rows and not self._waiting
        while True:
            try:  # idle: wake up now and then to check on the program and on deadlines
                kind, value = self._inbox.get(block=idle, timeout=1.0 if idle else None)
            except queue.Empty:
                return True
            idle = False
            if kind == "add":
                self._waiting.append(value)
            elif kind == "cancel":
                self._cancel(value)
            elif kind == "stop":
                self._end_all("abort", None)
                return False
            self.waiting = len(self._waiting)

    def _cancel(self, request_id: int) -> None:
        for request in list(self._waiting):
            if request.id == request_id:
                self._waiting.remove(request)
                self._unqueue()
                self._emit(request, TokenEvent(None, finish_reason="cancelled"))
        for slot, row in enumerate(self.rows):
            if row is not None and row.request.id == request_id:
                self._free(slot, TokenEvent(None, finish_reason="cancelled"))

    def _end_all(self, reason: str, error: str | None) -> None:
        while self._waiting:
            self._unqueue()
            self._emit(self._waiting.popleft(), TokenEvent(None, finish_reason=reason, error=error))
        for slot, row in enumerate(self.rows):
            if row is not None:
                self._free(slot, TokenEvent(None, finish_reason=reason, error=error))
        self.waiting = 0

    def _free(self, slot: int, final: TokenEvent | None) -> None:
        row = self.core.end(slot)
        if final is not None:
            self._emit(row.request, final)

    def _emit(self, request: EngineRequest, event: TokenEvent) -> bool:
        try:
            request.sink(event)
            return True
        except Exception:  # e.g. the client's event loop is closed: treat as a cancellation
            log.debug("sink of request %d failed; dropping it", request.id, exc_info=True)
            return False

    def _admit(self) -> None:
        # Every row of a call writes positions pos .. pos+L-1, so a prompt that still needs L tokens
        # prefilled joins only while each decoding row has L free positions; otherwise it waits a few
        # steps. A row's pos is that of its next call, pipelined or not.
        room = self.core.room()
        queued_for: dict[int, int] = {}  # busy slot -> steps of the requests already waiting for it
        for request in list(self._waiting):
            if self.active_rows >= self.usable:
                break
            slot, cached = self.core.choose(request.prompt, self.usable)
            if len(request.prompt) - cached > room:
                continue
            if self.prefix_affinity:
                busy, shared, steps = self.core.busy_prefix(request.prompt)
                saved = shared - cached
                wait = steps + queued_for.get(busy, 0)
                if busy is not None and saved >= AFFINITY_MIN_TOKENS and saved > self.step_cost_tokens * wait:
                    if not self.core.copies:  # it takes the row when it ends; with copies, only its prefix
                        queued_for[busy] = wait + request.max_tokens
                    continue
            request.cached_tokens = self.core.start(slot, request).cached
            self._waiting.remove(request)
            self._unqueue()
        self.waiting = len(self._waiting)

    def _call_inputs(self, only: int | None = None, masks=None) -> list[torch.Tensor]:
        return self.core.call_inputs(only=only, masks=masks)

    def _row_masks(self):
        """(masks, ok): the allowed-token masks of the next call (None: no row is constrained); ok is
        False when a grammar is in an error state, which ends every constrained row and this turn."""
        try:
            return self.core.masks(), True
        except ConstraintError as exc:
            for slot in self.core.constrained():
                self._free(slot, TokenEvent(None, finish_reason="error", error=str(exc), cause="grammar"))
            return None, False

    def _isolate(self, error: Exception, masks) -> None:
        """Building the call failed: free only the rows whose own values fail (each tried alone);
        the others run at the next turn, untouched (nothing ran, so no state moved)."""
        bad = []
        for slot, row in enumerate(self.rows):
            if row is None:
                continue
            try:
                self._call_inputs(only=slot, masks=masks)
            except Exception as exc:  # noqa: BLE001 - any failure of this row's values is this row's
                bad.append((slot, exc))
        if not bad:  # no single row explains it: a bug, not a value; fail the call's rows
            log.error("building a step failed for no single row: %s", error)
            bad = [(slot, error) for slot, row in enumerate(self.rows) if row is not None]
        for slot, exc in bad:
            log.warning("request %d failed while building a step: %s", self.rows[slot].request.id, exc)
            self._free(slot, TokenEvent(None, finish_reason="error", error=f"invalid request values: {exc}"))

    def _step(self) -> None:
        self.core.draft()  # draft-verifying programs: each row's drafts for this call
        masks, ok = self._row_masks()
        if not ok:
            return
        try:
            inputs = self._call_inputs(masks=masks)
        except Exception as exc:  # noqa: BLE001 - a row's value that slipped past the checks
            self._isolate(exc, masks)
            return
        try:
            outputs = self.program.execute(inputs)
        except Exception as exc:
            log.error("program call failed: %s", exc)
            self._fail_rows(str(exc))
            self._keep_program_up()
            return
        self.steps += 1
        gone = set()  # rows freed while reading: a draft program's call may have more events for them
        for slot, request, event in self.core.read(outputs):
            if slot in gone:
                continue
            if event.token is not None:
                self.tokens += 1
            if not self._emit(request, event) and not event.finish_reason:
                self._free(slot, None)  # its client is gone
                gone.add(slot)
