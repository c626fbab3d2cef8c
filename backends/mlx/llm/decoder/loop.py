"""The on-device decode loop over a decoder .pte (see export.py), one sequence at a time.

    decoder = Decoder("model.pte")
    for step in decoder.stream(prompt_ids, max_tokens=64, params=SamplingParams(temperature=0.8, seed=1)):
        print(step.token)

A generation is a batch of one request driven through DecodeRows (decode_rows.py), which holds the
step rules the server's engine runs too: step 0 prefills the prompt in one call, step k > 0 feeds the
previous token; seeded programs draw with seed = params.seed + step; a pipelined program feeds the
device's own token and returns each step one call later (same tokens, one extra step at the end). A
program exported with --batch B > 1 runs too: the other rows idle.

The rows' KV caches outlive a generation: `stream(..., reuse=True)` prefills only what the cache does
not hold yet (runtime/decode_rows.h), which `etmlx chat` and `etmlx.stream_generate(..., prompt_cache=...)` use.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError, Matcher, ProgramGrammar
from backends.mlx.llm.decoder.decode_rows import DecodeRows, Row, Sequence, TokenEvent
from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.image_encoder import ImageEncoder, PromptImages
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.tokenizer_files import ProgramTokenizer
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method


@dataclass
class Step:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    first_token_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


def check_prompt(meta: DecoderMeta, prompt_ids, max_tokens: int) -> list[int]:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    ids = list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < meta.vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be ints in [0, {meta.vocab_size})")
    if len(ids) + max_tokens > meta.max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the program's "
                         f"max_seq_len {meta.max_seq_len}")
    return ids


def decode_alone(rows: DecodeRows, execute, request: Sequence, reuse: bool, started, owner: str = "Decoder",
                 budget: DraftBudget | None = None) -> Iterator[TokenEvent]:
    """One request as a batch of one: it takes a free row of `rows` (with `reuse`, the one whose cache holds
    most of its prompt), the other rows idle; its events until it ends, each call being `execute(inputs)`.
    `started(row)` is told the row before its first call. A row's error raises ConstraintError."""
    if rows.active:  # its calls would advance the unfinished one's row too
        raise RuntimeError(f"another generation of this {owner} is unfinished: exhaust or close() it first")
    slot, _ = rows.choose(request.prompt, rows.meta.batch, reuse)
    row = rows.start(slot, request, reuse=reuse, budget=budget)
    started(row)
    try:
        while rows.rows[slot] is row:
            rows.draft()  # draft-verifying programs: the row's drafts for this call
            outputs = execute(rows.call_inputs(masks=rows.masks()))
            for _, _, event in rows.read(outputs):  # only this row is active
                if event.error:
                    raise ConstraintError(event.error)
                yield event
    except (GeneratorExit, ConstraintError):  # the caller stopped, or a grammar did: the caches are whole
        raise
    except BaseException:  # a failed call (or draft source) may have left the caches half written
        rows.forget()
        raise
    finally:
        if rows.rows[slot] is row:
            rows.end(slot)


class Decoder(ProgramTokenizer, ProgramGrammar):
    def __init__(self, pte: Path, prefill_step_size: int | None = None):
        """`prefill_step_size` (mlx-lm's name): prompt tokens per prefill call (None: 512; 0: the whole prompt in
        one call), where the program allows it (decode_rows.py checked_prefill_chunk)."""
        self.pte = Path(pte)
        if not self.pte.is_file():
            raise FileNotFoundError(f"{self.pte} does not exist")
        self.meta = DecoderMeta.load(self.pte)
        self.method = load_method(self.pte)
        self.meta.check_program(self.pte, self.method.input_specs())
        self._tokenizer = None
        self._vocabulary = None
        # the step rules; its row caches persist between generations
        self.rows = DecodeRows(self.meta, copy_rows=self.method.copy_rows if self.method.can_copy_rows else None,
                               prefill_chunk=prefill_step_size)
        self.last_cached = 0
        self.last_slot = 0
        self._images: ImageEncoder | None = None

    @property
    def images(self) -> ImageEncoder:
        """A vision-language program's image encoder (its vision method, loaded on first use)."""
        if not self.meta.takes_images:
            raise ValueError(f"{self.pte} takes no images: it was exported from a text-only model")
        if self._images is None:
            self._images = ImageEncoder(self.pte, self.meta)
        return self._images

    def stream(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None,
               stop_at_eos: bool = True, constraint: Constraint | None = None, reuse: bool = False,
               images=None, adapter: str | None = None) -> Iterator[Step]:
        """`adapter`: the name of a switchable LoRA adapter of the program (DecoderMeta.adapters) the
        generation runs with; None, the base model.
        With a constraint the output matches it (ending with EOS once complete), or stops at max_tokens.
        `reuse`: start from the longest prefix of the prompt that a row's KV cache still holds from an
        earlier generation (runtime/decode_rows.h); `last_cached` then says how many prompt tokens were not prefilled.
        `images`: a vision-language program's RGB PIL images, in the order of the prompt's image positions
        (image_prompt.py builds such prompts), or their PromptImages already encoded."""
        params = params or SamplingParams()
        params.check(self.meta.config, self.meta.vocab_size)
        prompt = check_prompt(self.meta, prompt_ids, max_tokens)
        prompt_images = None
        if isinstance(images, PromptImages):
            prompt_images = images
        elif images:
            prompt, prompt_images = self.images.prompt(prompt, list(images))
        elif self.meta.takes_images and self.meta.image_token_id in prompt:
            raise ValueError("the prompt has image positions but no images were given")
        index = self.meta.adapter_index(adapter)
        matcher = self.matcher(constraint) if constraint is not None else None
        request = Sequence(prompt, params, max_tokens, stop_at_eos, matcher=matcher, prompt_images=prompt_images,
                           adapter=index)
        with closing(decode_alone(self.rows, self.method.execute, request, reuse, self._started)) as events:
            for event in events:  # closing: a caller that stops early frees the row at once
                yield Step(event.token, event.logprob, event.top)

    def _started(self, row: Row) -> None:
        self.last_cached = row.cached
        self.last_slot = row.slot

    def propose(self, prompt_ids, params: SamplingParams | None = None, reuse: bool = True) -> list[int]:
        """A --propose-tokens K program (proposer.py): its K tokens after `prompt_ids` from one call, the row's
        cache reused as stream()'s `reuse` does. The tokens past the first are written into the row's cache but
        not recorded there: the next call feeds them again, overwriting."""
        if not self.meta.propose_tokens:
            raise ValueError(f"{self.pte} proposes one token per call: export the draft model with "
                             "--propose-tokens K")
        ids = list(prompt_ids)
        for _ in self.stream(ids, 1, params, stop_at_eos=False, reuse=reuse):
            pass
        # Positions past the cache's end were computed at its last position: meaningless, left out.
        return [int(t) for t in self.rows.proposals[self.last_slot]][:self.meta.max_seq_len - len(ids)]

    def step_at(self, feed: list[int], start: int, params: SamplingParams, step: int,
                matcher: Matcher | None = None) -> Step:
        """One call for row 0 at an explicit cache position and step, outside a generation: for loops
        of their own (a benchmark's sample-check-resample). `matcher` masks the call and advances on its
        token. Unpipelined programs only (a pipelined call returns the call before's token)."""
        if self.meta.pipelined:
            raise ValueError("step_at needs an unpipelined program")
        rows = DecodeRows(self.meta, prompt_cache=False)
        rows.start(0, Sequence(list(feed), params, 1, stop_at_eos=False, matcher=matcher), reuse=False)
        rows.place(0, start, step)
        self.rows.forget()  # this call writes into row 0's cache behind the generations' back
        [(_, _, event)] = rows.read(self.method.execute(rows.call_inputs(masks=rows.masks())))
        if event.error:
            raise ConstraintError(event.error)
        return Step(event.token, event.logprob, event.top)

    def generate(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None,
                 constraint: Constraint | None = None, adapter: str | None = None) -> Generation:
        out = Generation(prompt_tokens=len(list(prompt_ids)))
        start = time.perf_counter()
        decode_start = start
        for step in self.stream(prompt_ids, max_tokens, params, constraint=constraint, adapter=adapter):
            if not out.tokens:
                decode_start = time.perf_counter()
                out.first_token_s = decode_start - start
            out.tokens.append(step.token)
            if step.logprob is not None:
                out.logprobs.append(step.logprob)
                out.top_logprobs.append(step.top)
        decode_s = time.perf_counter() - decode_start
        out.prefill_tokens_per_s = out.prompt_tokens / out.first_token_s if out.first_token_s > 0 else 0.0
        out.decode_tokens_per_s = (len(out.tokens) - 1) / decode_s if decode_s > 0 and len(out.tokens) > 1 else 0.0
        out.finish_reason = "stop" if out.tokens and out.tokens[-1] in self.meta.eos_token_ids else "length"
        return out
