"""Where drafted tokens come from, for speculative decoding (speculative.py).

A source proposes up to k tokens that it expects to follow `prompt + output`; the program then verifies them
(sampler/draft_verification.py), so a wrong guess costs speed, never correctness. The sources and the budget are
implemented once, in the C++ core (runtime/draft_sources.h), which etmlx_decode and etmlx_bench run too; these
classes are their Python API.

- NgramDraft: prompt lookup (llama.cpp's lookup decoding, vLLM's n-gram proposer): find the last n tokens of
  the sequence earlier in it (n from max_ngram down to min_ngram, the most recent match) and propose what
  followed them there. Hits on text that repeats its context: code edits, quotes, extraction, summaries.
- PredictionDraft: Predicted Outputs (OpenAI's `prediction`): the caller's expected output. A cursor follows
  the output through the prediction; where they diverge the cursor re-aligns on the prediction's next match
  of the output's last tokens (an edited line in an otherwise unchanged file), or waits until one appears.
"""

from __future__ import annotations

from backends.mlx.runtime.decode_rows_lib import BudgetCore, DecodeRowsError, DraftSourceCore


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _native(make):
    try:
        return make()
    except DecodeRowsError as exc:  # the core's one-line refusal (a bad n-gram range, a negative id)
        raise ValueError(str(exc)) from None


class NgramDraft:
    name = "ngram"

    def __init__(self, max_ngram: int | None = None, min_ngram: int | None = None):
        """None: the core's default (draft_sources.h NgramDraft::kMaxNgram, kMinNgram)."""
        default_max, default_min = DraftSourceCore.ngram_defaults()
        max_ngram = default_max if max_ngram is None else max_ngram
        min_ngram = default_min if min_ngram is None else min_ngram
        _check_int("max_ngram", max_ngram)
        _check_int("min_ngram", min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._core = _native(lambda: DraftSourceCore.ngram(max_ngram, min_ngram))

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        # Never more than the sequence holds: the room for the answer is allocated up front.
        return self._core.propose(prompt, output, min(k, len(prompt) + len(output)))


class PredictionDraft:
    name = "prediction"

    def __init__(self, prediction: list[int]):
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prediction):
            raise ValueError("the prediction must be token ids (ints >= 0)")
        self.prediction = list(prediction)
        self._core = _native(lambda: DraftSourceCore.prediction(self.prediction))

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Follows the output so far through the prediction (a source keeps its cursor: one per sequence)."""
        return self._core.propose(prompt, output, min(k, len(self.prediction)))


class _Constant:
    """A DraftBudget constant, read from the core (draft_sources.h) when first asked for."""

    def __init__(self, which: int, kind):
        self.which, self.kind = which, kind

    def __get__(self, obj, owner):
        return self.kind(BudgetCore.constant(self.which))


class DraftBudget:
    """How many drafts to ask for next, from the acceptance seen so far (draft_sources.h says how).

    A call accepting n of k drafts is n successes and, when n < k, one failure, in a decayed acceptance
    estimate a; the budget takes the k <= K that maximises (1 + a + ... + a^k) / (1 + draft_cost * k). When
    that is 0 (a source that does not hit), it still probes one draft every PROBE_EVERY calls; each probe in a
    row that finds nothing doubles that wait (to at most 16 * PROBE_EVERY calls), an accepted draft resets it."""

    DRAFT_COST = _Constant(0, float)  # the default cost of one more drafted token, in decode calls
    DECAY = _Constant(1, float)
    PROBE_EVERY = _Constant(2, int)

    def __init__(self, max_drafts: int, draft_cost: float | None = None):
        self.max_drafts = max_drafts
        self._core = _native(lambda: BudgetCore(max_drafts, draft_cost))

    @property
    def rate(self) -> float:
        return self._core.rate

    @property
    def draft_cost(self) -> float:
        return self._core.draft_cost

    @draft_cost.setter
    def draft_cost(self, cost: float) -> None:
        _native(lambda: setattr(self._core, "draft_cost", cost))

    def size(self) -> int:
        return self._core.size()

    def update(self, proposed: int, accepted: int) -> None:
        self._core.update(proposed, accepted)
