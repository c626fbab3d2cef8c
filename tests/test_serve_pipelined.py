"""The engine over real pipelined programs (llm/decoder/pipelined.py): the same model exported
pipelined and unpipelined gives every request the same tokens and logprobs, bit for bit, under the
same arrivals; structured output is refused on a pipelined program, as a 400 over HTTP and an
LMTP error."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.meta import PIPELINED_HINT, DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.app import ServerThread
from backends.mlx.serve.engine import Engine, EngineRequest
from backends.mlx.serve.program_worker import ProgramWorker
from serve_helpers import bit_exact_batching, lmtp_exchange

pytestmark = pytest.mark.server  # program workers and a server

MAX_SEQ_LEN = 40


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
    out = tmp_path_factory.mktemp("serve_pipelined")
    config = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=4, logprobs=3, penalties=True)
    paths = {}
    for name, pipelined in (("pipelined", True), ("plain", False)):
        paths[name] = out / f"{name}.pte"
        export_decoder(model, paths[name], MAX_SEQ_LEN, batch=3, config=config, tokenizer=tok, pipelined=pipelined)
    paths["masked_pipelined"] = out / "masked_pipelined.pte"
    export_decoder(model, paths["masked_pipelined"], MAX_SEQ_LEN, batch=2, tokenizer=tok, pipelined=True,
                   config=SamplerConfig(top_k=True, allowed_mask=True))
    return paths, tok


def _turn(engine):
    assert engine._drain()
    engine._expire()
    engine._admit()
    if engine.active_rows:
        engine._step()


def _serve(pte, eos):
    """Each request's events under a fixed schedule of arrivals (turn -> requests) and one cancellation."""
    meta = DecoderMeta.load(pte)
    with bit_exact_batching():  # logprobs equal bit for bit whatever rows share a call
        worker = ProgramWorker(pte)
    engine = Engine(worker, meta)
    engine.running = True  # driven by hand, one loop turn at a time
    events = {}

    def request(name, prompt, max_tokens, stop_at_eos=True, forced=None, **params):
        events[name] = []
        return EngineRequest(prompt, SamplingParams(**params), max_tokens, events[name].append,
                             stop_at_eos=stop_at_eos, forced=forced)

    lower_eos = {eos: 2.0}  # (+2 on the end token: a sampled row ends early now and then)
    arrivals = {0: [request("sampled", [5, 6, 7], 12, temperature=0.9, seed=1, top_k=8, top_p=0.9),
                    request("one", list(range(10, 17)), 1, temperature=0.7, seed=2)],
                1: [request("greedy", list(range(20, 32)), 10, repetition_penalty=1.3),
                    request("cancelled", [3, 4], 20, temperature=1.0, seed=5)],
                3: [request("eos", [9], 30, temperature=1.2, seed=11, logit_bias=lower_eos, min_p=0.05)],
                5: [request("scored", [8, 9, 10], 6, stop_at_eos=False, forced=[40, 41, 42, 43, eos, 44])],
                6: [request("full", list(range(1, 31)), MAX_SEQ_LEN - 30, temperature=0.8, seed=3)]}
    try:
        for turn in range(400):
            for req in arrivals.get(turn, []):
                engine.submit(req)
                if req.max_tokens == 20:
                    cancelled = req
            if turn == 4:
                engine.cancel(cancelled.id)
            _turn(engine)
            if turn > max(arrivals) and not engine.active_rows and not engine.waiting:
                break
    finally:
        worker.close()
    return {name: [(e.token, e.logprob, e.top, e.finish_reason, e.error) for e in evs]
            for name, evs in events.items()}, engine


def test_pipelined_and_unpipelined_programs_give_the_same_results(programs):
    paths, tok = programs
    assert DecoderMeta.load(paths["pipelined"]).pipelined and not DecoderMeta.load(paths["plain"]).pipelined
    plain, plain_engine = _serve(paths["plain"], tok.eos_token_id)
    piped, piped_engine = _serve(paths["pipelined"], tok.eos_token_id)
    cancelled_plain, cancelled_piped = plain.pop("cancelled"), piped.pop("cancelled")
    assert piped == plain
    reasons = {name: evs[-1][3] for name, evs in plain.items()}
    assert reasons == {"sampled": reasons["sampled"], "one": "length", "greedy": "length", "eos": "stop",
                       "scored": "length", "full": "length"}
    assert len(plain["one"]) == 1 and len(plain["full"]) == MAX_SEQ_LEN - 30
    assert [e[0] for e in plain["scored"]] == [40, 41, 42, 43, tok.eos_token_id, 44]
    assert all(e[1] is not None and len(e[2]) == 3 for evs in plain.values() for e in evs)
    # Cancelled at the same turn: fewer tokens for the pipelined row (its tokens come a call later, and it
    # joined later, as a pipelined row ending frees its slot one call later), the same ones.
    assert cancelled_plain[-1][3] == cancelled_piped[-1][3] == "cancelled"
    assert cancelled_piped[:-1] == cancelled_plain[:len(cancelled_piped) - 1]
    for engine, events in ((plain_engine, [*plain.values(), cancelled_plain]),
                           (piped_engine, [*piped.values(), cancelled_piped])):
        assert engine.tokens == sum(e[0] is not None for evs in events for e in evs)
    assert piped_engine.steps > plain_engine.steps  # the extra call per row that returns its last token


def test_structured_output_on_a_pipelined_program_is_refused_clearly(programs):
    from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError

    paths, _ = programs
    pte = paths["masked_pipelined"]
    engine = Engine(None, DecoderMeta.load(pte), pte=pte)
    with pytest.raises(ConstraintError, match="needs an unpipelined program"):
        engine.check(EngineRequest([1], SamplingParams(), 4, lambda e: None, constraint=Constraint("json_object")))
    server = ServerThread(pte, model_name="tiny").start()
    try:
        body = {"prompt": [1, 2], "max_tokens": 4, "response_format": {"type": "json_object"}}
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=60)
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"]["message"] == PIPELINED_HINT
        frame = "GENERATE " + json.dumps({"stream_id": "j", **body})  # LMTP: an error message for that stream
        messages = asyncio.run(lmtp_exchange(server, [frame], lambda m: any(PIPELINED_HINT in json.dumps(p)
                                                                                for _, p in m), timeout=60))
        ends = [e for kind, p in messages if kind == "TOKEN" for e in p if e.get("finish_reason")]
        assert ends == [{"stream_id": "j", "finish_reason": "error", "error": PIPELINED_HINT}] or \
            any(p.get("stream_id") == "j" and p.get("error") == PIPELINED_HINT for kind, p in messages if kind == "MSG")
        body.pop("response_format")  # the same program serves unconstrained requests
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
