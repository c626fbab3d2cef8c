"""The engine's scheduling, against a stand-in program that records each call (no export needed):
joining at the next call, waiting for cache room, cancellation, shutdown, failures."""

from __future__ import annotations

import pytest
import torch

from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.engine import Engine, EngineRequest

VOCAB = 50


def _meta(batch=2, max_seq_len=16, config=None, pipelined=False, eos=(0,)):
    return DecoderMeta.build(max_seq_len=max_seq_len, vocab_size=VOCAB, batch=batch, eos_token_ids=list(eos),
                             seeded=True, config=config or SamplerConfig(logprobs=2, logit_bias=1, penalties=True),
                             dtype="float32", pipelined=pipelined)


class Recorder:
    """Returns token (start_pos + length + last fed token + seed) % 40 + 1 per row (never the eos id 0),
    logprob -token / 10: a function of everything a row's step depends on."""

    def __init__(self, meta, fail=False):
        self.meta, self.fail, self.calls = meta, fail, []

    def execute(self, inputs):
        named = dict(zip(self.meta.inputs, inputs))
        self.calls.append({k: named[k].clone() for k in ("tokens", "start_pos", "lengths", "seed", "penalty_reset")
                           if k in named})
        if self.fail:
            raise RuntimeError("device lost")
        return self._outputs(named, named["tokens"])

    def _outputs(self, named, fed):
        last = fed.gather(1, (named["lengths"] - 1).unsqueeze(1)).squeeze(1)
        tokens = (named["start_pos"] + named["lengths"] + last + named["seed"]) % 40 + 1
        batch = tokens.shape[0]
        return [tokens, -tokens / 10.0, torch.stack([tokens, tokens + 1], 1), torch.zeros(batch, 2)]


class PipelinedRecorder(Recorder):
    """The same steps as a pipelined program (pipelined.py): a token < 0 feeds the row's last sampled
    token, and each call returns the previous call's outputs (zeros before the first)."""

    def __init__(self, meta, fail=False):
        super().__init__(meta, fail)
        batch = meta.batch
        self.last = [torch.zeros(batch, dtype=torch.int64), torch.zeros(batch), torch.zeros(batch, 2, dtype=torch.int64),
                     torch.zeros(batch, 2)]

    def _outputs(self, named, fed):
        fed = torch.where(fed < 0, self.last[0].unsqueeze(1), fed)
        previous, self.last = self.last, super()._outputs(named, fed)
        return previous


def _engine(meta=None, fail=False):
    meta = meta or _meta()
    engine = Engine((PipelinedRecorder if meta.pipelined else Recorder)(meta, fail), meta)
    engine.running = True  # driven by hand below, one loop turn at a time
    return engine


def _turn(engine):
    assert engine._drain()
    engine._admit()
    if engine.active_rows:
        engine._step()


def _request(prompt, max_tokens, events, **params):
    return EngineRequest(list(prompt), SamplingParams(**params), max_tokens, events.append)


def test_a_new_request_is_prefilled_in_the_same_call_as_a_decoding_row():
    engine = _engine()
    a, b = [], []
    engine.submit(_request([1, 2], 5, a, seed=10))
    _turn(engine)  # a's prefill
    engine.submit(_request([3, 4, 5, 6], 5, b, seed=20))
    _turn(engine)
    call = engine.program.calls[-1]
    assert call["tokens"].shape == (2, 4)  # the longest row sets the width
    assert call["tokens"][1].tolist() == [3, 4, 5, 6] and call["tokens"][0, 0].item() == a[0].token
    assert call["start_pos"].tolist() == [2, 0] and call["lengths"].tolist() == [1, 4]
    assert call["seed"].tolist() == [11, 20]  # each row's own step
    assert call["penalty_reset"].tolist() == [0, 1]  # only the new row starts its penalty counts


def test_a_long_prompt_waits_while_a_row_lacks_cache_room():
    engine = _engine(_meta(max_seq_len=16))
    a, b = [], []
    engine.submit(_request(list(range(1, 11)), 6, a))  # ends at position 15
    _turn(engine)
    for _ in range(3):
        _turn(engine)  # a now writes at position 13: 3 positions of room
    engine.submit(_request([1, 2, 3, 4], 2, b))
    _turn(engine)
    assert engine.waiting == 1 and not b
    while not (a and a[-1].finish_reason):
        _turn(engine)
    assert a[-1].finish_reason == "length" and len(a) == 6
    _turn(engine)
    assert engine.waiting == 0 and b and b[0].token is not None
    assert all(int(c["start_pos"].max() + c["tokens"].shape[1]) <= 16 for c in engine.program.calls)


def test_cancel_frees_waiting_and_running_requests():
    engine = _engine(_meta(batch=1))
    a, b = [], []
    ra = _request([1], 10, a)
    rb = _request([2], 10, b)
    engine.submit(ra), engine.submit(rb)
    _turn(engine)
    assert engine.active_rows == 1 and engine.waiting == 1
    engine.cancel(rb.id)
    engine.cancel(ra.id)
    _turn(engine)
    assert a[-1].finish_reason == "cancelled" and b == [b[-1]] and b[-1].finish_reason == "cancelled"
    assert (engine.active_rows, engine.waiting) == (0, 0) and engine.rows == [None]


def test_stop_aborts_everything_and_the_thread_ends():
    meta = _meta(batch=1)
    engine = Engine(Recorder(meta), meta).start()
    a, b = [], []
    engine.submit(_request([1], 12, a))
    engine.submit(_request([2], 12, b))
    engine.stop()
    assert not engine.running and not engine._thread.is_alive()
    assert a[-1].finish_reason in ("abort", "length") and b[-1].finish_reason in ("abort", "length")
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit(_request([1], 2, []))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failing_program_ends_its_rows_with_an_error_and_the_engine_goes_on(pipelined):
    engine = _engine(_meta(pipelined=pipelined), fail=True)
    a = []
    engine.submit(_request([1, 2], 3, a))
    _turn(engine)
    assert a[-1].finish_reason == "error" and "device lost" in a[-1].error and engine.active_rows == 0
    engine.program.fail = False
    b = []
    engine.submit(_request([1, 2], 3, b))
    for _ in range(3 + pipelined):  # a pipelined row's first token comes one call after its prefill
        _turn(engine)
    assert [e.finish_reason for e in b] == [None, None, "length"]


def test_a_sink_that_fails_frees_its_row():
    engine = _engine()

    def broken(event):
        raise RuntimeError("event loop is closed")

    engine.submit(EngineRequest([1], SamplingParams(), 5, broken))
    _turn(engine)
    assert engine.active_rows == 0


def test_bad_requests_are_refused_before_queueing():
    engine = _engine()
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit(_request([1] * 10, 7, []))
    with pytest.raises(ValueError, match="top_k"):
        engine.submit(_request([1], 2, [], top_k=5))  # not exported
    plain = _engine(_meta(config=SamplerConfig(logprobs=2)))
    scoring = EngineRequest([1], SamplingParams(), 2, [].append, stop_at_eos=False, forced=[3, 4])
    with pytest.raises(ValueError, match="scoring is not available for this .pte"):
        plain.submit(scoring)
    with pytest.raises(ValueError, match=r"max_batch must be an int in \[1, 2\]"):
        Engine(Recorder(_meta()), _meta(), max_batch=3)


def _slipped(**values):
    """SamplingParams holding values its own check refuses (as if a check were missing somewhere)."""
    params = SamplingParams()
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("bad", [{"top_k": 10 ** 30}, {"seed": 2 ** 63 - 1}])  # the second overflows at seed + 1
def test_a_value_that_fails_building_a_step_fails_only_its_row(bad):
    meta = _meta(batch=3, config=SamplerConfig(logprobs=2, top_k=True, penalties=True))
    solo = _engine(meta)
    alone = []
    solo.submit(_request([1, 2], 4, alone, seed=7))
    while not (alone and alone[-1].finish_reason):
        _turn(solo)
    engine = _engine(meta)
    a, b, c = [], [], []
    engine.submit(_request([1, 2], 4, a, seed=7))
    engine.submit(EngineRequest([3], _slipped(**bad), 4, b.append))
    engine.submit(_request([1, 2], 4, c, seed=7))
    while engine.active_rows or engine.waiting or not a:
        _turn(engine)
    assert [e.finish_reason for e in b] == (["error"] if "top_k" in bad else [None, "error"])
    assert "invalid request values" in b[-1].error
    expected = [(e.token, e.finish_reason) for e in alone]
    assert [(e.token, e.finish_reason) for e in a] == expected == [(e.token, e.finish_reason) for e in c]
    assert engine.active_rows == 0


# ---- pipelined programs: the same results, one call later ----

def _scenario(meta, forced, cancel_turn=4):
    """Requests arriving at different turns, of different prompt lengths and max_tokens (1 and one that
    fills the cache among them), two scored (one with a wrong forced token), one cancelled mid-stream;
    each request's events, by name, and the engine."""
    engine = _engine(meta)
    events = {}

    def request(name, prompt, max_tokens, **extra):
        events[name] = []
        return EngineRequest(list(prompt), SamplingParams(**extra.pop("params", {})), max_tokens,
                             events[name].append, **extra)

    # `forced`: the tokens the Recorder samples for [9, 8, 7] with the default params ("ref").
    arrivals = {0: [request("a", [1, 2], 5, params={"seed": 10}), request("one", [4, 5, 6], 1)],
                1: [request("full", list(range(1, 11)), 6, stop_at_eos=False)],
                2: [request("cancelled", [7], 12, params={"seed": 3})],
                3: [request("ref", [9, 8, 7], 4, stop_at_eos=False), request("b", [3, 1], 8, params={"seed": 5})],
                6: [request("score", [9, 8, 7], 4, stop_at_eos=False, forced=forced),
                    request("bad_score", [9, 8, 7], 4, stop_at_eos=False, forced=forced[:2] + [forced[2] + 1] + forced[3:])]}
    cancelled = None
    for turn in range(200):
        for req in arrivals.get(turn, []):
            engine.submit(req)
            cancelled = req if req.prompt == [7] else cancelled
        if turn == cancel_turn:
            engine.cancel(cancelled.id)
        _turn(engine)
        if turn > max(arrivals) and not engine.active_rows and not engine.waiting:
            break
    return events, engine


def test_a_pipelined_program_gives_each_request_the_same_events():
    solo = _engine(_meta(batch=1))
    ref = []
    solo.submit(EngineRequest([9, 8, 7], SamplingParams(), 4, ref.append, stop_at_eos=False))
    while not (ref and ref[-1].finish_reason):
        _turn(solo)
    forced = [e.token for e in ref]

    def run(pipelined):
        meta = _meta(batch=3, pipelined=pipelined, eos=(0, 39))
        events, engine = _scenario(meta, forced)
        for req_events in events.values():
            assert req_events[-1].finish_reason is not None and all(e.finish_reason is None for e in req_events[:-1])
        return {name: [(e.token, e.logprob, e.top, e.finish_reason, e.error) for e in evs]
                for name, evs in events.items()}, engine

    plain, plain_engine = run(False)
    piped, piped_engine = run(True)
    cancelled_plain, cancelled_piped = plain.pop("cancelled"), piped.pop("cancelled")
    assert piped == plain
    assert plain["one"][-1][3] == "length" and len(plain["one"]) == 1
    assert len(plain["full"]) == 6 and plain["full"][-1][3] == "length"
    assert plain["b"][-1][3] == "stop" and len(plain["b"]) == 6  # eos 39
    assert plain["bad_score"][-1][3] == "error" and len(plain["bad_score"]) == 3
    # Cancelled at the same turn, a pipelined row has delivered one token fewer: a prefix of the same tokens.
    assert cancelled_piped[-1][3] == cancelled_plain[-1][3] == "cancelled"
    assert cancelled_piped[:-1] == cancelled_plain[:len(cancelled_piped) - 1]
    assert len(cancelled_piped) == len(cancelled_plain) - 1
    assert piped_engine.tokens == plain_engine.tokens - 1  # the token the cancelled row had not delivered yet
    # Decode calls feed the device's own token; no call writes past the cache.
    calls = piped_engine.program.calls
    assert any((c["tokens"][:, 0] == -1).any() for c in calls)
    assert all(int((c["start_pos"] + c["tokens"].shape[1]).max()) <= 16 for c in calls)
    assert all(c["tokens"].min() >= -1 and (c["tokens"][:, 1:] >= 0).all() for c in calls)


def test_a_pipelined_row_gets_its_first_token_one_call_after_its_prefill():
    engine = _engine(_meta(batch=1, pipelined=True))
    a = []
    engine.submit(_request([1, 2], 2, a, seed=4))
    _turn(engine)
    assert a == [] and engine.active_rows == 1
    _turn(engine)
    assert [e.finish_reason for e in a] == [None]
    _turn(engine)  # computes a third step, which is dropped
    assert [e.finish_reason for e in a] == [None, "length"] and engine.active_rows == 0
    calls = engine.program.calls
    assert [c["tokens"][0].tolist() for c in calls] == [[1, 2], [-1], [-1]]
    assert [c["start_pos"].tolist() for c in calls] == [[0], [2], [3]]
    assert [c["seed"].tolist() for c in calls] == [[4], [5], [6]]
    b = []  # the freed slot is reused at once; its stale device token is never fed
    engine.submit(_request([3], 1, b))
    _turn(engine), _turn(engine)
    assert [e.finish_reason for e in b] == ["length"]
    assert calls[3]["tokens"][0].tolist() == [3] and calls[3]["penalty_reset"].tolist() == [1]


def test_structured_output_is_refused_on_a_pipelined_program(tmp_path):
    from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError
    from backends.mlx.llm.decoder.meta import PIPELINED_HINT

    meta = _meta(config=SamplerConfig(allowed_mask=True), pipelined=True)
    engine = Engine(PipelinedRecorder(meta), meta, pte=tmp_path / "never_read.pte")
    engine.running = True
    request = _request([1], 2, [])
    request.constraint = Constraint("json_object")
    with pytest.raises(ConstraintError) as info:
        engine.submit(request)
    assert str(info.value) == PIPELINED_HINT and engine.waiting == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_rows_of_a_worker_that_died_between_calls_end_with_an_error(pipelined):
    meta = _meta(pipelined=pipelined)

    class Supervised(PipelinedRecorder if pipelined else Recorder):  # SupervisedProgram's up / recover
        up, restarts = True, 0

        def recover(self):
            if not self.up:
                self.up, self.restarts = True, self.restarts + 1

    engine = Engine(Supervised(meta), meta)
    engine.running = True
    a, b = [], []
    engine.submit(_request([1, 2], 5, a))
    _turn(engine), _turn(engine)
    engine.program.up = False  # the worker is gone, and with it the row's cache
    engine._keep_program_up()
    assert a[-1].finish_reason == "error" and "exited" in a[-1].error and engine.active_rows == 0
    assert engine.program.restarts == 1
    engine.submit(_request([1, 2], 2, b))
    for _ in range(3):
        _turn(engine)
    assert [e.finish_reason for e in b] == [None, "length"]


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_long_prompt_is_prefilled_in_chunks_beside_a_decoding_row(pipelined):
    """With prefill_step_size 3 a 7-token prompt takes calls of 3, 3 and 1 tokens while the other row decodes one
    token a call; both rows' tokens are those of the unchunked engine (control: chunks off, one 7-token call)."""
    meta = _meta(max_seq_len=32, config=SamplerConfig(logprobs=2, logit_bias=1), pipelined=pipelined)
    runs = {}
    for step_size in (3, 0):
        engine = Engine((PipelinedRecorder if pipelined else Recorder)(meta), meta, prefill_step_size=step_size)
        engine.running = True
        a, b = [], []
        engine.submit(_request([1, 2], 6, a, seed=10))
        _turn(engine)
        engine.submit(_request([3, 4, 5, 6, 7, 8, 9], 4, b, seed=20))
        while not (a and a[-1].finish_reason and b and b[-1].finish_reason):
            _turn(engine)
        widths = [int(c["lengths"][1]) for c in engine.program.calls[1:4]]
        runs[step_size] = ([e.token for e in a], [e.token for e in b], widths)
    assert runs[3][:2] == runs[0][:2]
    assert runs[3][2] == [3, 3, 1] and runs[0][2][0] == 7
