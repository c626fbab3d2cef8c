"""One choice's token events to OpenAI output pieces: text (multi-byte safe, cut at stop strings),
the logprob data of each emitted token, and the finish reason.

The end-of-sequence token ends a choice with "stop" and is counted in usage, but is neither text
nor a logprob entry (it has no text). A stop string ends it with "stop" too; the text stops before
the stop string, and the tokens after the one that completed it are never generated (the row is
cancelled at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer, StopStrings
from backends.mlx.serve.engine import TokenEvent

# Engine endings that are not OpenAI finish reasons.
_FINISH = {"cancelled": "abort", "abort": "abort"}


@dataclass
class Piece:
    text: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)  # emitted tokens with their logprob data
    finish_reason: str | None = None
    error: str | None = None
    client_error: bool = False  # the error is the request's own grammar failing (400, not 500)
    tool_calls: list = field(default_factory=list)  # tool_output.IssuedCall: calls this piece completes


class ChoiceText:
    def __init__(self, tokenizer, prompt: list[int], stops: list[str], eos_ids, keep_special: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt, keep_special) if tokenizer is not None else None
        self.stops = StopStrings(stops)
        self.eos_ids = set(eos_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens its engine row reused (usage.prompt_tokens_details)
        self.drafts = (0, 0)  # draft programs: (proposed, accepted) drafts of its row so far
        self.finished = False

    def feed(self, event: TokenEvent) -> Piece:
        piece = Piece()
        if self.finished:
            return piece
        if event.token is not None:
            self.completion_tokens += 1
            self.cached_tokens = event.cached_tokens
            self.drafts = (event.drafts_proposed, event.drafts_accepted)
            if not (event.finish_reason == "stop" and event.token in self.eos_ids):
                piece.tokens.append(event)
                if self.detok is not None:
                    piece.text = self.stops.feed(self.detok.add(event.token))
        if self.stops.stopped:
            piece.finish_reason = "stop"
        elif event.finish_reason:
            if self.detok is not None:
                piece.text += self.stops.feed(self.detok.flush())
            piece.text += self.stops.flush()
            piece.finish_reason = "stop" if self.stops.stopped else _FINISH.get(event.finish_reason,
                                                                                  event.finish_reason)
            piece.error = event.error
            piece.client_error = event.cause == "grammar"
        self.finished = piece.finish_reason is not None
        return piece
