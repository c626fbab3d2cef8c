"""Where drafted tokens come from, for speculative decoding (speculative.py).

A source proposes up to k tokens that it expects to follow `prompt + output`; the program then verifies them
(sampler/draft_verification.py), so a wrong guess costs speed, never correctness.

- NgramDraft: prompt lookup (llama.cpp's lookup decoding, vLLM's n-gram proposer): find the last n tokens of
  the sequence earlier in it (n from max_ngram down to min_ngram, the most recent match) and propose what
  followed them there. Hits on text that repeats its context: code edits, quotes, extraction, summaries.
- PredictionDraft: Predicted Outputs (OpenAI's `prediction`): the caller's expected output. A cursor follows
  the output through the prediction; where they diverge the cursor re-aligns on the prediction's next match
  of the output's last tokens (an edited line in an otherwise unchanged file), or waits until one appears.
"""

from __future__ import annotations


def _check_ngram(max_ngram: int, min_ngram: int) -> None:
    for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram {min_ngram} exceeds max_ngram {max_ngram}")


def _last_match(haystack: list[int], needle: list[int], end: int) -> int | None:
    """The largest j <= end - len(needle) where haystack[j:j+len(needle)] == needle, or None."""
    n = len(needle)
    for j in range(end - n, -1, -1):
        if haystack[j:j + n] == needle:
            return j
    return None


class NgramDraft:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        _check_ngram(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        seq = prompt + output
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            # An earlier occurrence of the last n tokens (not the suffix itself), with something after it.
            j = _last_match(seq, seq[-n:], len(seq) - 1)
            if j is not None:
                return seq[j + n:j + n + k]
        return []


class PredictionDraft:
    name = "prediction"
    ALIGN = 3  # output tokens matched to re-align after a divergence (fewer where the output is shorter)

    def __init__(self, prediction: list[int]):
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prediction):
            raise ValueError("the prediction must be token ids (ints >= 0)")
        self.prediction = list(prediction)
        self.cursor: int | None = 0  # where the next output token should be in the prediction (None: lost)
        self.anchor = 0  # the last place the cursor was aligned: re-alignment looks after it first
        self.seen = 0  # output tokens the cursor has accounted for

    def _advance(self, output: list[int]) -> None:
        pred = self.prediction
        for token in output[self.seen:]:
            if self.cursor is not None and self.cursor < len(pred) and pred[self.cursor] == token:
                self.cursor += 1
                self.anchor = self.cursor
            else:
                self.cursor = None
        self.seen = len(output)
        if self.cursor is None and output:
            for n in range(min(self.ALIGN, len(output)), 0, -1):
                j = self._next_match(output[-n:])
                if j is not None:
                    self.cursor = j + n
                    break

    def _next_match(self, needle: list[int]) -> int | None:
        """The prediction's first occurrence of `needle` at or after the anchor, else its first anywhere."""
        pred, n = self.prediction, len(needle)
        for start in (self.anchor, 0):
            for j in range(start, len(pred) - n + 1):
                if pred[j:j + n] == needle:
                    return j
        return None

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        self._advance(output)
        if k < 1 or self.cursor is None:
            return []
        return self.prediction[self.cursor:self.cursor + k]


class DraftBudget:
    """How many drafts to ask for next, from the acceptance seen so far.

    Drafts are Bernoulli trials until the first rejection: a call accepting n of k drafts saw n successes and,
    when n < k, one failure. With a (decayed) acceptance estimate a, k drafts yield 1 + a + ... + a^k tokens
    per call at a cost of about 1 + DRAFT_COST * k calls' time; the budget takes the k <= K that maximises
    their ratio. When that is 0 (a source that does not hit), it still probes one draft every PROBE_EVERY calls,
    so a source that starts hitting is noticed, at a cost well under 5% of the calls' time.
    """

    DRAFT_COST = 0.1  # one more drafted token's share of a decode call's time (the per-call overhead dominates)
    DECAY = 0.8
    PROBE_EVERY = 16

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.hits, self.trials = 2.0, 2.0  # optimistic start: a fresh source gets the full budget at once
        self.calls_without = 0

    @property
    def rate(self) -> float:
        return self.hits / self.trials if self.trials else 0.0

    def size(self) -> int:
        a, best, best_value = self.rate, 0, 1.0
        expected = 1.0
        for k in range(1, self.max_drafts + 1):
            expected += a ** k
            value = expected / (1 + self.DRAFT_COST * k)
            if value > best_value:
                best, best_value = k, value
        if best == 0 and self.calls_without + 1 >= self.PROBE_EVERY:
            return 1
        return best

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            self.calls_without += 1
            return
        self.calls_without = 0
        self.hits = self.DECAY * self.hits + accepted
        self.trials = self.DECAY * self.trials + accepted + (1 if accepted < proposed else 0)
