"""Token ids to streamed text: incremental detokenization and stop strings.

Byte-level tokenizers split multi-byte characters across tokens, and many tokenizers decode a
token differently depending on what precedes it (leading spaces). So each new piece of text is
the difference between decoding a short window of ids with and without the newest tokens, and
nothing is emitted while the window ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"
_CONTEXT = 4  # prompt tokens kept as decoding context for the first generated tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), keep_special: bool = False):
        """keep_special: special tokens come out as their text (tool-call markers such as [TOOL_CALLS])."""
        self.tokenizer = tokenizer
        self.skip_special = not keep_special
        self.ids = list(prompt_ids)[-_CONTEXT:]
        self.prefix = 0  # window start
        self.read = len(self.ids)  # ids before this are already emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """The text `token` completes ('' while a character is still incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is left undecoded at the end (an incomplete character comes out as U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopStrings:
    """Cuts a text stream at the first stop string. Text that might be the start of a stop string
    is held back until the next piece decides it."""

    def __init__(self, stops):
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit now; sets `stopped` when a stop string appeared (it is not emitted)."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        hold = 0
        for s in self.stops:  # the longest suffix of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
