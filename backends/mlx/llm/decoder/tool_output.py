"""An answer's text, as it streams, split into content and tool calls (the server's deltas, the CLI, the API).

Text before the call marker is content, given out as it comes except a tail that could still become the
marker. From the marker on, the text is held: complete calls are given out as soon as they parse (a hermes
block at its closing tag; the other syntaxes at the end), each with its id. When the held text does not
parse as calls to known functions at the end, it is content after all. The non-streamed answer is the same
split done at once (feed everything, then finish), so the deltas always reassemble to it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from backends.mlx.llm.decoder.tool_formats import ToolCall, call_start, may_start, parse_calls


@dataclass
class IssuedCall:
    index: int
    id: str
    call: ToolCall


def new_call_id(fmt: str = "hermes") -> str:
    """A call's id; Mistral's templates accept only 9 letters and digits as the id a result answers."""
    return uuid.uuid4().hex[:9] if fmt == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


class ToolOutput:
    def __init__(self, fmt: str, names: set[str]):
        self.fmt, self.names = fmt, names
        self.pending = ""  # content held back (could be the start of the marker)
        self.calls_text: str | None = None  # from the marker on
        self.consumed = 0  # characters of calls_text already given out as calls
        self.calls: list[IssuedCall] = []

    def _issue(self, calls: list[ToolCall]) -> list[IssuedCall]:
        out = [IssuedCall(len(self.calls) + i, new_call_id(self.fmt), c) for i, c in enumerate(calls)]
        self.calls += out
        return out

    def feed(self, text: str) -> tuple[str, list[IssuedCall]]:
        """(content, new calls) that `text` completes."""
        if self.calls_text is not None:
            self.calls_text += text
            return "", self._complete_calls(final=False)
        self.pending += text
        start = call_start(self.fmt, self.pending)
        if start is None:
            hold = may_start(self.fmt, self.pending)
            content, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
            return content, []
        content, self.calls_text, self.pending = self.pending[:start], self.pending[start:], ""
        return content, self._complete_calls(final=False)

    def _complete_calls(self, final: bool) -> list[IssuedCall]:
        parsed = parse_calls(self.fmt, self.calls_text[self.consumed:], self.names, final=final)
        if parsed is None:
            return []
        calls, used = parsed
        self.consumed += used
        return self._issue(calls)

    def finish(self) -> tuple[str, list[IssuedCall]]:
        """(content, new calls) at the end: held text that is not calls is content."""
        if self.calls_text is None:
            content, self.pending = self.pending, ""
            return content, []
        rest = self.calls_text[self.consumed:]
        if not rest.strip():
            return "", []
        calls = self._complete_calls(final=True)
        if calls:
            return "", calls
        return rest, []  # not calls after all (or calls to unknown functions): the text as the model wrote it

    def split(self, text: str) -> tuple[str, list[IssuedCall]]:
        """The whole answer at once: (content, calls)."""
        content, calls = self.feed(text)
        more, last = self.finish()
        return content + more, calls + last
