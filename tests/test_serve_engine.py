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


def _meta(batch=2, max_seq_len=16, config=None):
    return DecoderMeta.build(max_seq_len=max_seq_len, vocab_size=VOCAB, batch=batch, eos_token_ids=[0], seeded=True,
                             config=config or SamplerConfig(logprobs=2, logit_bias=1, penalties=True), dtype="float32")


class Recorder:
    """Returns token (start_pos + length) % 40 + 1 per row (never the eos id 0), logprob -1."""

    def __init__(self, meta, fail=False):
        self.meta, self.fail, self.calls = meta, fail, []

    def execute(self, inputs):
        named = dict(zip(self.meta.inputs, inputs))
        self.calls.append({k: named[k].clone() for k in ("tokens", "start_pos", "lengths", "seed", "penalty_reset")
                           if k in named})
        if self.fail:
            raise RuntimeError("device lost")
        tokens = (named["start_pos"] + named["lengths"]) % 40 + 1
        batch = tokens.shape[0]
        return [tokens, torch.full((batch,), -1.0), torch.zeros(batch, 2, dtype=torch.int64), torch.zeros(batch, 2)]


def _engine(meta=None, fail=False):
    meta = meta or _meta()
    engine = Engine(Recorder(meta, fail), meta)
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


def test_a_failing_program_ends_its_rows_with_an_error_and_the_engine_goes_on():
    engine = _engine(fail=True)
    a = []
    engine.submit(_request([1, 2], 3, a))
    _turn(engine)
    assert a[-1].finish_reason == "error" and "device lost" in a[-1].error and engine.active_rows == 0
    engine.program.fail = False
    b = []
    engine.submit(_request([1, 2], 3, b))
    for _ in range(3):
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
