"""Decode steps to text responses: what `etmlx generate`, `etmlx chat` and the Python API
(`etmlx.stream_generate`) share.

One Response per generated token, as mlx-lm's stream_generate yields them: `text` is the new piece
(possibly '' while a multi-byte character is incomplete, or while it might begin a stop string). The
last response has a finish_reason: "stop" (end-of-sequence token or a stop string) or "length". The
end-of-sequence token itself adds no text.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass
from typing import Iterator

from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer, StopStrings


@dataclass
class Response:
    text: str
    token: int
    logprob: float | None  # the chosen token's logprob (programs exported with --logprobs N)
    top_logprobs: list[tuple[int, float]] | None  # (token id, logprob) of the top N, best first
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float  # prompt tokens / time to first token
    generation_tokens: int
    generation_tps: float  # tokens after the first / time since the first
    cached_tokens: int = 0  # prompt tokens the prompt cache supplied (not prefilled again)
    proposed_draft_tokens: int = 0  # speculative decoding (a --draft-tokens program): drafts sent so far
    accepted_draft_tokens: int = 0  # of those, accepted (each one a token without a call of its own)

    @property
    def logprobs(self) -> dict[int, float] | None:
        """token id -> logprob for the chosen token and the top alternatives: `r.logprobs[r.token]` as in
        mlx-lm (where it is the whole vocabulary's vector)."""
        if self.logprob is None:
            return None
        return {**dict(self.top_logprobs or ()), self.token: self.logprob}


def stream_text(decoder, prompt_ids: list[int], max_tokens: int, params=None, stop=(),
                tokenizer=None, constraint=None, reuse: bool = False, speculation=None, images=None,
                adapter: str | None = None) -> Iterator[Response]:
    """Responses for one generation; `tokenizer` None gives '' texts (token ids only); `constraint`
    (constraints.Constraint) makes the output match a schema, regex, choice or grammar; `reuse`: start
    from what the program's row caches hold of the prompt (Decoder.stream). `speculation`
    (speculation.Speculation): `decoder` is a SpeculativeDecoder, decoded with these drafts. `images`: a
    vision-language program's RGB images for the prompt's image positions (Decoder.stream). `adapter`: a
    switchable LoRA adapter's name (Decoder.stream)."""
    stops = StopStrings(stop)
    if stops.stops and tokenizer is None:
        raise ValueError("stop strings need text: this program has no tokenizer")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
    if speculation is not None:
        steps = speculation.steps(decoder, prompt_ids, max_tokens, params, constraint=constraint, reuse=reuse)
    else:
        extra = {"images": images} if images else {}
        if adapter:
            extra["adapter"] = adapter
        steps = decoder.stream(prompt_ids, max_tokens, params, constraint=constraint, reuse=reuse, **extra)
    with closing(steps):  # leaving early (a stop string) ends the decoder's generation now, not at collection
        yield from _responses(decoder, steps, prompt_ids, max_tokens, stops, detok, speculation is not None)


def _responses(decoder, steps, prompt_ids, max_tokens, stops, detok, speculative) -> Iterator[Response]:
    start = time.perf_counter()
    first = None
    count = 0
    for step in steps:
        now = time.perf_counter()
        first = first or now
        count += 1
        eos = step.token in decoder.meta.eos_token_ids
        text = stops.feed(detok.add(step.token)) if detok and not eos else ""
        finish = "stop" if eos or stops.stopped else ("length" if count == max_tokens else None)
        if finish and detok and not stops.stopped:
            text += stops.feed(detok.flush()) + stops.flush()
        yield Response(text=text, token=step.token, logprob=step.logprob, top_logprobs=step.top, finish_reason=finish,
                       prompt_tokens=len(prompt_ids), prompt_tps=len(prompt_ids) / max(first - start, 1e-9),
                       generation_tokens=count,
                       generation_tps=(count - 1) / (now - first) if count > 1 and now > first else 0.0,
                       cached_tokens=decoder.last_cached,
                       proposed_draft_tokens=decoder.stats.proposed if speculative else 0,
                       accepted_draft_tokens=decoder.stats.accepted if speculative else 0)
        if finish:
            return
