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
    # After the optimistic start, one drafted token per PROBE_EVERY calls, and each probe that finds nothing
    # doubles the wait, up to 16 times PROBE_EVERY: a dead source's probes (verifying calls) cost under 1% of
    # the calls in the end.
    late = DraftBudget(8)
    sizes = []
    for _ in range(1500):
        sizes.append(late.size())
        late.update(sizes[-1], 0)
    drafting = [i for i, k in enumerate(sizes) if k]
    stopped = sizes.index(0) - 1  # the optimistic start's last proposal
    probes = [i for i in drafting if i > stopped]
    every = DraftBudget.PROBE_EVERY
    gaps = [b - a for a, b in zip([stopped] + probes, probes)]
    assert gaps[:5] == [every, 2 * every, 4 * every, 8 * every, 16 * every] and set(gaps[5:]) == {16 * every}, gaps
    assert all(sizes[i] == 1 for i in probes)
    assert proposed < 0.15 * calls
    # A source that starts hitting after a miss streak gets its budget back at its next probe, and the wait
    # between probes is PROBE_EVERY again once one finds a hit.
    for _ in range(16 * every):
        k = late.size()
        late.update(k, k)
    assert late.size() == 8
    again = DraftBudget(8)
    sizes = []
    for call in range(400):
        sizes.append(again.size())
        again.update(sizes[-1], sizes[-1] if call == 118 else 0)  # only the third probe hits
    assert [i for i in range(7, 119) if sizes[i]] == [22, 54, 118]  # waits of 16, 32, 64 calls
    last = next(i for i in range(119, 400) if sizes[i] == 0) - 1  # the hit brought proposals back, until misses
    assert next(i for i in range(last + 1, 400) if sizes[i]) - last == every  # the wait is PROBE_EVERY again


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


def _round(pacing, seq, drafts, draft_s, at, took):
    """One proposal after `seq` at time `at`: `drafts` made in one draft call of `draft_s` seconds, then the
    target's calls take `took` seconds; returns the budget asked for."""
    size = pacing.begin(seq, at)
    made = drafts[:size]
    spent = draft_s if made else 0.0  # no drafts: no draft call
    pacing.end(seq, True, made, 1 if made else 0, spent, at + spent)
    return size, at + spent + took


def test_draft_model_pacing_stops_a_draft_model_that_costs_more_than_it_saves():
    """A one-call draft model whose every draft is accepted but whose call costs 8 plain calls: once a plain call
    is timed (the pacing asks for one, once) its cost is counted in plain calls, and it stops drafting, probing
    rarely enough that probes cost under 2% of the time (DraftBudget::kProbeShare)."""
    from backends.mlx.runtime.decode_rows_lib import PacingCore

    plain_s, draft_s = 0.001, 0.008
    pacing = PacingCore(8, one_call=True)
    seq, at, sizes = [1, 2, 3], 0.0, []
    pacing.begin(seq, at)
    pacing.end(seq, False, [], 0, 0.0, at)  # the prompt's proposal (its prefill): nothing to learn from
    at += 0.01
    for _ in range(400):
        size, next_at = _round(pacing, seq, list(range(100, 108)), draft_s, at, 0.0)
        sizes.append(size)
        # every draft accepted: the target's call brings them and one more token; a verifying call of
        # k drafts takes (1 + 0.05 k) plain calls, a plain call 1
        took = plain_s * (1 + 0.05 * size)
        seq = seq + list(range(100, 100 + size)) + [7]
        at = next_at + took
    assert sizes[0] == 8  # a fresh budget: all of it
    assert 0 in sizes[:3]  # one plain call, to time the unit
    assert pacing.proposal_cost() == pytest.approx(draft_s / plain_s, rel=0.05)
    assert pacing.get()[3] == pytest.approx(0.1)  # a verifying call's cost per draft: the default's floor
    late = sizes[20:]
    probes = sum(1 for k in late if k)
    # each probe costs ~9 plain calls: at most 2% of the calls
    assert probes * (draft_s / plain_s + 1) <= 0.02 * len(late) + 9, sizes


def test_draft_model_pacing_keeps_a_draft_model_that_pays():
    """The same with a draft call costing half a plain call and 90% of the drafts accepted: it keeps drafting."""
    from backends.mlx.runtime.decode_rows_lib import PacingCore

    plain_s, draft_s = 0.001, 0.0005
    pacing = PacingCore(8, one_call=True)
    seq, at, sizes = [1, 2, 3], 0.0, []
    pacing.begin(seq, at)
    pacing.end(seq, False, [], 0, 0.0, at)
    at += 0.01
    for i in range(200):
        size, next_at = _round(pacing, seq, list(range(100, 108)), draft_s, at, 0.0)
        sizes.append(size)
        accepted = size if i % 10 else max(size - 1, 0)  # one rejection in ten proposals
        seq = seq + list(range(100, 100 + accepted)) + [7]
        at = next_at + plain_s * (1 + 0.05 * size)
    assert pacing.proposal_cost() == pytest.approx(draft_s / plain_s, rel=0.05)
    assert min(sizes[20:]) >= 4, sizes
