"""Draft sources and the adaptive draft budget (llm/decoder/draft_sources.py), without a program."""

from __future__ import annotations

import pytest

from backends.mlx.llm.decoder.draft_sources import DraftBudget, NgramDraft, PredictionDraft


def test_ngram_proposes_what_followed_the_most_recent_earlier_match():
    source = NgramDraft(max_ngram=3)
    prompt = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8]
    assert source.propose(prompt, [1, 2, 3], 3) == [4, 5, 9]  # the longest n-gram first: "1 2 3"
    assert source.propose(prompt, [6, 2, 3], 3) == [7, 8, 6]  # "6 2 3" is new; "2 3" last came before 7 8
    assert NgramDraft(max_ngram=3).propose([1, 2, 3, 4, 5, 1, 2, 3], [], 2) == [4, 5]
    assert source.propose([1, 2, 3], [4], 3) == []  # 4 never occurred before
    assert source.propose(prompt, [1, 2, 3], 0) == []
    assert source.propose(prompt, [1, 2, 3], 10**12) == [4, 5, 9, 2, 3, 7, 8, 1, 2, 3]  # k past the sequence: all of it


def test_ngram_checks_its_sizes():
    with pytest.raises(ValueError, match="min_ngram 3 exceeds max_ngram 2"):
        NgramDraft(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_ngram must be an int >= 1"):
        NgramDraft(max_ngram=0)


def test_prediction_follows_the_output_and_realigns_after_an_edit():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    source = PredictionDraft(prediction)
    assert source.propose([1], [], 3) == [10, 11, 12]
    assert source.propose([1], [10, 11], 3) == [12, 13, 14]
    # The output replaced 12 by 99 (an edit): lost until the output meets the prediction again.
    assert source.propose([1], [10, 11, 99], 3) == []
    assert source.propose([1], [10, 11, 99, 13], 3) == [14, 15, 16]
    assert source.propose([1], [10, 11, 99, 13, 14, 15, 16, 17], 3) == []  # the prediction is used up
    assert PredictionDraft(prediction).propose([1], [10], 10**12) == prediction[1:]
    with pytest.raises(ValueError, match="token ids"):
        PredictionDraft([1, -2])


def test_budget_gives_a_hitting_source_the_full_budget_and_a_missing_one_probes_rarely():
    hitting = DraftBudget(8)
    for _ in range(10):
        k = hitting.size()
        hitting.update(k, k)
    assert hitting.size() == 8
    missing = DraftBudget(8)
    proposed = calls = 0
    for _ in range(200):
        k = missing.size()
        missing.update(k, 0)
        proposed += k
        calls += 1
    # After the optimistic start, one drafted token per PROBE_EVERY calls: a few percent of a call's work.
    late = DraftBudget(8)
    while late.size() != 1 or late.rate > 0.01:  # misses until the estimate is near 0, up to a probe
        late.update(late.size(), 0)
    late.update(1, 0)
    sizes = []
    for _ in range(64):
        k = late.size()
        late.update(k, 0)
        sizes.append(k)
    assert sum(sizes) == 64 // DraftBudget.PROBE_EVERY
    assert proposed < 0.15 * calls
    # A source that starts hitting after a miss streak gets its budget back.
    for _ in range(40):
        k = late.size()
        late.update(k, k)
    assert late.size() == 8


def test_draft_model_pacing_learns_from_the_sequence_that_follows():
    """The draft model's bookkeeping (draft_sources.h DraftModelPacing, which the Python DraftModel and
    etmlx_decode --draft-model both run): the acceptance of its last drafts is read off the next proposal's
    sequence, another sequence teaches nothing, and a measured cost is a draft call over the time between two
    proposals."""
    from backends.mlx.runtime.decode_rows_lib import DecodeRowsError, PacingCore

    fixed = PacingCore(4, cost=0)
    assert fixed.begin([1, 2, 3], 0.0) == 4  # a fresh budget: all of it
    fixed.end([1, 2, 3], False, [7, 8, 9, 10], 4, 0.004, 0.0)
    fixed.begin([1, 2, 3, 7, 8, 5], 0.01)  # the target took 7 and 8, then corrected: 2 of 4 accepted
    calls, seconds, rate, cost = fixed.get()
    assert calls == 4 and seconds == pytest.approx(0.004)
    assert rate == pytest.approx((0.8 * 2 + 2) / (0.8 * 2 + 2 + 1))  # DraftBudget's decayed estimate
    assert cost == pytest.approx(DraftBudget.DRAFT_COST)  # cost 0: only the verifying call's share
    fixed.end([1, 2, 3, 7, 8, 5], True, [6], 1, 0.001, 0.02)
    fixed.begin([9, 9], 0.03)  # another sequence: the last proposal's fate is unknown
    assert fixed.get()[2] == pytest.approx(rate)

    measured = PacingCore(4)
    measured.begin([1], 0.0)
    measured.end([1], True, [2, 3], 2, 0.002, 0.0)  # 1 ms a draft call
    measured.begin([1, 2, 3, 4], 0.004)  # the next proposal 4 ms later: both drafts accepted
    assert measured.get()[3] == pytest.approx(DraftBudget.DRAFT_COST + 0.001 / 0.004)
    with pytest.raises(DecodeRowsError, match="max_drafts must be >= 0"):
        PacingCore(-1)
