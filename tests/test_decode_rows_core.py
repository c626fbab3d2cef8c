"""The decode-step rules' one implementation (runtime/decode_rows.h), driven through ctypes as the Python engine
drives it; etmlx_decode links the same source (test_cpp_decode_runner.py runs it against the Python loop)."""

from __future__ import annotations

import pytest

from backends.mlx.runtime import decode_rows_lib as lib
from backends.mlx.runtime.decode_rows_lib import DecodeRowsError, RowsCore


def _core(batch=2, max_seq_len=32, *, ring=False, prompt_cache=True, pipelined=False, draft_tokens=0, eos=(9,),
          copies=False) -> RowsCore:
    return RowsCore(batch, max_seq_len, ring=ring, prompt_cache=prompt_cache, pipelined=pipelined,
                    draft_tokens=draft_tokens, eos=list(eos), copies=copies)


def _start(core, slot, prompt, max_tokens=4, seed=0, forced=None, constrained=False, reuse=True, copy=None,
           stop_at_eos=True):
    return core.start(slot, prompt, max_tokens, stop_at_eos, forced, seed, constrained, reuse, copy)


def test_prefill_then_one_token_per_step_with_the_seed_schedule():
    core = _core()
    _start(core, 0, [1, 2, 3], seed=100)
    tokens, per_row = core.layout()
    assert tokens[0] == [1, 2, 3] and per_row["start_pos"][0] == 0 and per_row["lengths"][0] == 3
    assert per_row["seeds"][0] == 100 and per_row["first"][0] == 1 and per_row["kinds"][0] == lib.REQUEST
    assert per_row["kinds"][1] == lib.IDLE and per_row["lengths"][1] == 1 and per_row["seeds"][1] == 0
    [event] = core.read([5, 0], None)
    assert (event["slot"], event["token"], lib.FINISH[event["finish"]]) == (0, 5, None)
    tokens, per_row = core.layout()
    assert tokens[0] == [5] and per_row["start_pos"][0] == 3 and per_row["seeds"][0] == 101
    assert per_row["first"][0] == 0


def test_pipelined_prefill_returns_nothing_and_steps_feed_the_device_token():
    core = _core(pipelined=True)
    _start(core, 0, [1, 2], max_tokens=2)
    core.layout()
    assert core.read([7, 0], None) == []  # the prefill's outputs are the slot's previous call's
    tokens, per_row = core.layout()
    assert tokens[0] == [-1] and per_row["start_pos"][0] == 2 and per_row["seeds"][0] == 1
    [event] = core.read([4, 0], None)
    assert event["token"] == 4
    assert core.tokens(0, lib.HELD) == [1, 2, 4]  # the fed-back token is what the cache holds at position 2


def test_eos_and_max_tokens_end_a_row_and_free_its_slot():
    core = _core()
    _start(core, 0, [1], max_tokens=2)
    _start(core, 1, [1], max_tokens=5, stop_at_eos=True)
    core.layout()
    events = core.read([3, 9], None)  # row 1 drew eos
    assert [lib.FINISH[e["finish"]] for e in events] == [None, "stop"] and core.active == 1
    core.layout()
    [event] = core.read([3, 0], None)
    assert lib.FINISH[event["finish"]] == "length" and core.active == 0
    assert core.row(0, ended=True)["produced"] == 2 and core.row(0) is None


def test_scoring_forces_each_step_and_fails_on_a_mismatch():
    core = _core(batch=1)
    _start(core, 0, [1, 2], max_tokens=2, forced=[6, 7])
    _, per_row = core.layout()
    assert per_row["kinds"][0] == lib.FORCED and per_row["forced"][0] == 6
    core.read([6], None)
    core.layout()
    [event] = core.read([8], None)
    assert lib.FINISH[event["finish"]] == "error" and event["failure"] == lib.FORCED_FAILURE
    assert core.failure_message(event["failure"], event["detail"]) == "could not force token 7"


def test_a_grammar_rejecting_a_token_fails_only_its_row_and_an_exception_is_re_raised():
    core = _core()
    _start(core, 0, [1], constrained=True)
    _start(core, 1, [1])
    core.layout()
    events = core.read([4, 4], None, lambda slot, token: False)
    assert [e["failure"] for e in events] == [lib.GRAMMAR, lib.NO_FAILURE]
    _start(core, 0, [1], constrained=True)
    core.layout()
    with pytest.raises(KeyError, match="matcher broke"):
        core.read([4, 4], None, lambda slot, token: (_ for _ in ()).throw(KeyError("matcher broke")))


def test_the_prompt_cache_reuses_the_longest_prefix_then_the_least_recently_used_row():
    core = _core(batch=3)
    _start(core, 0, [1, 2, 3, 4], max_tokens=1)
    core.layout()
    core.read([5, 0, 0], None)
    assert core.tokens(0, lib.HELD) == [1, 2, 3, 4]
    assert core.choose([1, 2, 3, 8], usable=3, reuse=True) == (0, 3)
    assert core.choose([1, 2, 3, 4], usable=3, reuse=True) == (0, 3)  # the last prompt token is fed again
    assert core.choose([7], usable=3, reuse=True) == (1, 0)  # nothing to reuse: the least recently used
    assert _start(core, 0, [1, 2, 3, 8]) == 3
    tokens, per_row = core.layout()
    assert tokens[0] == [8] and per_row["start_pos"][0] == 3


def test_a_ring_row_is_reused_only_where_positions_continue():
    core = _core(batch=1, ring=True)
    _start(core, 0, [1, 2, 3], max_tokens=1)
    core.layout()
    core.read([5], None)
    assert core.reusable(0, [1, 2, 3, 4]) == 3  # extends everything it holds
    assert core.reusable(0, [1, 2, 9, 4]) == 0  # would keep a stale ring slot


def test_cross_row_copies_take_the_longest_prefix_another_row_holds_and_survive_a_failed_copy():
    core = _core(batch=2, copies=True)
    _start(core, 0, [1, 2, 3, 4], max_tokens=3)
    core.layout()
    core.read([5, 0], None)  # row 0 goes on running: its prefix can still be copied
    copies = []
    assert _start(core, 1, [1, 2, 3, 7], copy=lambda src, dst, n: copies.append((src, dst, n)) or True) == 3
    assert copies == [(0, 1, 3)] and core.tokens(1, lib.HELD) == [1, 2, 3]
    core.end(1)
    core.set_held(1, [])
    assert _start(core, 1, [1, 2, 3, 7], copy=lambda src, dst, n: False) == 0  # the whole prompt is prefilled


def test_drafts_are_bounded_by_the_call_and_accepted_drafts_advance_the_row():
    core = _core(batch=1, max_seq_len=16, draft_tokens=4)
    _start(core, 0, [1, 2, 3], max_tokens=6)
    assert core.draft_room(0, 10) == 4 and core.draft_room(0, 2) == 2
    with pytest.raises(DecodeRowsError, match="more drafts than the call has room for"):
        core.set_drafts(0, [1, 2, 3, 4, 5])
    core.set_drafts(0, [4, 5, 6])
    tokens, per_row = core.layout()
    assert tokens[0] == [1, 2, 3, 4, 5, 6] and per_row["lengths"][0] == 6
    events = core.read([7], [2])  # two drafts accepted, then the call's own token
    assert [e["token"] for e in events] == [4, 5, 7] and events[-1]["accepted"] == 2
    row = core.row(0)
    assert (row["pos"], row["step"], row["produced"]) == (5, 3, 3)  # past the fed and accepted tokens
    assert core.tokens(0, lib.OUTPUT) == [4, 5, 7] and core.tokens(0, lib.HELD) == [1, 2, 3, 4, 5]


def test_each_event_counts_the_drafts_up_to_its_own_token():
    """A verifying call's events: an accepted draft is one proposed and accepted, the call's own token settles
    the rest (rejected). A reply cut after a draft (a stop string, Predicted Outputs' usage) thus counts only
    the drafts it returned; every event carried the whole call's counts (8 accepted for 1 token)."""
    core = _core(batch=1, max_seq_len=32, draft_tokens=4)
    _start(core, 0, [1, 2, 3], max_tokens=20)
    core.set_drafts(0, [4, 5, 6, 8])
    core.layout()
    events = core.read([7], [3])  # three of four drafts accepted, then the call's own token
    assert [e["token"] for e in events] == [4, 5, 6, 7]
    assert [(e["proposed"], e["accepted"]) for e in events] == [(1, 1), (2, 2), (3, 3), (4, 3)]
    core.set_drafts(0, [12, 10])
    core.layout()
    events = core.read([11], [2])
    assert [(e["proposed"], e["accepted"]) for e in events] == [(5, 4), (6, 5), (6, 5)]
    row = core.row(0)
    assert (row["proposed"], row["accepted"]) == (6, 5)


def test_a_row_ending_inside_a_call_totals_its_drafts_up_to_the_end():
    core = _core(batch=1, max_seq_len=32, draft_tokens=4, eos=(5,))
    _start(core, 0, [1, 2, 3], max_tokens=20)
    core.set_drafts(0, [4, 5, 6, 8])
    core.layout()
    events = core.read([7], [4])  # all four accepted, but the second is the end-of-sequence token
    assert [(e["token"], e["proposed"], e["accepted"]) for e in events] == [(4, 1, 1), (5, 2, 2)]
    assert lib.FINISH[events[-1]["finish"]] == "stop"
    row = core.row(0, ended=True)
    assert (row["proposed"], row["accepted"]) == (2, 2)


def test_bad_requests_get_one_line_errors():
    core = _core(batch=2)
    with pytest.raises(DecodeRowsError, match=r"no row 5 \(the program has 2\)"):
        _start(core, 5, [1])
    with pytest.raises(DecodeRowsError, match="the prompt is empty"):
        _start(core, 0, [])
    _start(core, 0, [1])
    with pytest.raises(DecodeRowsError, match="row 0 is busy"):
        _start(core, 0, [1])
    core.end(0)
    _start(core, 0, [1], seed=2 ** 63 - 1)
    core.layout()
    core.read([4, 0], None)
    with pytest.raises(DecodeRowsError, match="overflows int64"):
        core.layout()
    assert core.layout(only=1)[1]["kinds"] == [lib.IDLE, lib.IDLE]  # the other rows still lay out
    with pytest.raises(DecodeRowsError, match="max_seq_len"):
        _core(max_seq_len=0)


class _VerifyingDevice:
    """A pipelined draft-verifying program over a fixed continuation (pipelined_verify.py's contract): the
    model's next token after `prompt + ref[:j]` is ref[j]; drafts are accepted while they match it."""

    def __init__(self, prompt_len: int, ref: list[int]):
        self.prompt_len, self.ref, self.last = prompt_len, ref, 0
        self.delivered = self.calls = 0

    def __call__(self, core) -> tuple[list[int], list[int], list[int]]:
        tokens, per_row = core.layout()
        deliver, start, length = per_row["deliver"][0], per_row["start_pos"][0], per_row["lengths"][0]
        row = [self.last if t < 0 else t for t in tokens[0][:length]]
        n_drafts = len(core.tokens(0, lib.DRAFTS))
        fed_end = start + length - n_drafts  # positions start .. fed_end - 1 are fed tokens
        accepted = 0
        while accepted < n_drafts and row[length - n_drafts + accepted] == self.ref[fed_end + accepted - self.prompt_len]:
            accepted += 1
        token = self.ref[fed_end + accepted - self.prompt_len]
        fed, self.last = self.last, token
        self.calls += 1
        self.delivered += deliver
        return ([token], [accepted], [fed]) if deliver else ([fed], [0], [fed])


@pytest.mark.parametrize("source", ["exact", "dry", "wrong"])
def test_pipelined_drafts_deliver_only_when_a_source_needs_the_token(source):
    """A pipelined draft program (the `deliver` input): calls without drafts do not deliver, the row's token
    comes back as the next call's `fed`, and the tokens are the plain continuation whatever the source does.
    A source that never proposes is asked again after 1, 2, 4 .. 16 undelivered calls: few calls deliver."""
    prompt, n, k = [1, 2, 3, 4], 100, 4
    ref = [(7 * i + 5) % 50 + 10 for i in range(n + k + 2)]
    core = _core(batch=1, max_seq_len=n + 16, pipelined=True, draft_tokens=k, eos=())
    _start(core, 0, prompt, max_tokens=n)
    device, out = _VerifyingDevice(len(prompt), ref), []
    while core.active:
        want = core.ask(0, k)
        seen = len(core.tokens(0, lib.OUTPUT))
        if source == "exact":
            drafts = ref[seen:seen + want]
        elif source == "wrong":
            drafts = [t + 1 for t in ref[seen:seen + want]]
        else:
            drafts = []
        core.set_drafts(0, drafts)
        tokens, accepted, fed = device(core)
        out += [e["token"] for e in core.read(tokens, accepted, None, fed=fed)]
    assert out == ref[:n]
    assert core.tokens(0, lib.HELD)[:len(prompt) + n - 1] == prompt + ref[:n - 1]
    if source == "dry":
        assert 3 <= device.delivered <= 12, device.delivered  # probes, backing off to one call in 17
        assert device.calls == n + 1
    if source == "exact":  # every call carries drafts after the first: each delivers K + 1 tokens
        assert device.delivered == device.calls <= -(-n // (k + 1)) + 1


def test_a_pending_row_takes_no_drafts():
    core = _core(batch=1, pipelined=True, draft_tokens=2, eos=())
    _start(core, 0, [1, 2], max_tokens=8)
    assert core.ask(0, 2) == 2
    core.set_drafts(0, [])  # nothing proposed: the prefill does not deliver
    _, per_row = core.layout()
    assert per_row["deliver"][0] == 0
    assert core.read([0], [0], None, fed=[0]) == []  # the slot's previous call's: skipped
    assert core.ask(0, 2) == 0  # its token is in flight: the source is not asked
    with pytest.raises(DecodeRowsError, match="in flight"):
        core.set_drafts(0, [5])
    tokens, per_row = core.layout()
    assert tokens[0] == [-1] and per_row["deliver"][0] == 1  # one empty answer: the next ask comes at once
    [e1, e2] = core.read([6], [0], None, fed=[5])  # the prefill's token, then this call's own
    assert (e1["token"], e2["token"]) == (5, 6) and core.tokens(0, lib.HELD) == [1, 2, 5]
    assert core.ask(0, 2) == 2
