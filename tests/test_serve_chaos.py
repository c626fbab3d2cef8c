"""The server against clients and failures that try to break it (issue 14): a bad value beside good
requests, a worker killed or stopped mid-stream, a flood beyond the queue, a huge prompt. Each test
asserts that the other clients get exactly what they get alone. Loopback only; no wall-clock
assertions (the deadlines here only bound how long a broken test waits)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from backends.mlx.serve.app import ServeLimits, ServerThread
from serve_helpers import bit_exact_batching, lmtp_exchange, stream_in_thread, tiny_pte, wait_for

pytestmark = pytest.mark.server  # servers on threads

PROMPT = [1, 5, 9]


def _post(server, path, body, timeout=60):
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def _health(server):
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _complete(server, max_tokens=6, seed=3, **extra):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, **extra}
    return _post(server, "/v1/completions", body)


def _tokens(server, max_tokens=6, seed=3):
    status, _, body = _complete(server, max_tokens, seed, logprobs=0)
    assert status == 200, body
    return body["choices"][0]["logprobs"]["tokens"], body["choices"][0]["finish_reason"]


def _server(tmp_path_factory, **limits):
    with bit_exact_batching():
        return ServerThread(tiny_pte(tmp_path_factory), model_name="tiny", limits=ServeLimits(**limits)).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _server(tmp_path_factory, step_timeout=5.0)
    yield srv
    srv.stop()


def _finished(messages):
    return {e["stream_id"]: e for kind, p in messages if kind == "TOKEN" for e in p if e.get("finish_reason")}


def _stream_tokens(messages, sid):
    return [e["token"] for kind, p in messages if kind == "TOKEN" for e in p
            if e["stream_id"] == sid and e.get("token") is not None]


def test_bad_values_are_refused_at_the_edge_while_good_requests_complete(server):
    solo = _tokens(server)
    with ThreadPoolExecutor(6) as pool:
        good = [pool.submit(_tokens, server) for _ in range(3)]
        bad = [pool.submit(_complete, server, top_k=10 ** 30), pool.submit(_complete, server, seed=2 ** 63)]
        assert [f.result() for f in good] == [solo] * 3
        for future, param in zip(bad, ("top_k", "seed")):
            status, _, body = future.result()
            assert status == 400 and body["error"]["param"] == param, body
    good = 'GENERATE {"stream_id": "ok", "prompt": [1, 5, 9], "max_tokens": 6, "temperature": 1.0, "seed": 3}'
    alone = asyncio.run(lmtp_exchange(server, [good], lambda m: "ok" in _finished(m), timeout=120))
    lines = [good, f'GENERATE {{"stream_id": "k", "prompt": [1], "top_k": {2 ** 63}}}',
             f'GENERATE {{"stream_id": "s", "prompt": [1], "seed": {2 ** 63 - 1}}}']
    messages = asyncio.run(lmtp_exchange(server, ["\n".join(lines)], lambda m: len(_finished(m)) == 3, timeout=120))
    ends = _finished(messages)
    assert "top_k" in ends["k"]["error"] and "seed" in ends["s"]["error"]
    assert ends["ok"]["finish_reason"] == "length" and ends["ok"].get("error") is None
    assert _stream_tokens(messages, "ok") == _stream_tokens(alone, "ok") and len(_stream_tokens(alone, "ok")) == 6


def _long_stream(server, events, max_tokens=50):
    """A streamed completion in a thread; `events` gets ("chunk", text) and ("end", error or None)."""
    return stream_in_thread(server.url, {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
                                         "stream": True,
                                         "logit_bias": {str(server.service.meta.eos_token_ids[0]): -100}}, events)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_worker_killed_or_stopped_mid_stream_fails_its_rows_and_is_replaced(server, how):
    solo = _tokens(server)
    supervisor = server.service.engine.program
    restarts = supervisor.restarts
    pid = supervisor.worker.pid
    events = []
    thread = _long_stream(server, events)
    assert wait_for(lambda: any(kind == "chunk" for kind, _ in events))
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    thread.join(120)
    end = events[-1]
    assert end[0] == "end" and end[1] is not None
    assert ("exited" if how == "kill" else "did not answer within 5 s") in end[1]
    assert wait_for(lambda: supervisor.restarts == restarts + 1 and _health(server)[0] == 200)
    assert supervisor.worker.pid != pid
    assert _tokens(server) == solo  # a new request on the new worker: the same tokens as before


def test_health_is_503_while_no_worker_is_up_and_the_server_gives_up_after_its_attempts(tmp_path_factory):
    srv = _server(tmp_path_factory, step_timeout=5.0, restart_attempts=2)
    try:
        supervisor = srv.service.engine.program
        start, gate, tries = supervisor._start, threading.Event(), []

        def slow_start():  # the first restart waits for the test, then fails; the second works
            tries.append(1)
            gate.wait(60)
            if len(tries) == 1:
                raise RuntimeError("no memory left (test)")
            return start()
        supervisor._start = slow_start
        supervisor.pause = 0.0
        os.kill(supervisor.worker.pid, signal.SIGKILL)
        assert wait_for(lambda: tries)
        status, body = _health(srv)
        assert status == 503 and body["status"] == "restarting"
        gate.set()
        assert wait_for(lambda: _health(srv)[0] == 200) and len(tries) == 2

        def never():
            raise RuntimeError("cannot load (test)")
        supervisor._start = never
        os.kill(supervisor.worker.pid, signal.SIGKILL)
        assert wait_for(lambda: not srv.service.engine.running)
        assert "could not be restarted" in srv.service.engine.fatal
        status, body = _health(srv)
        assert status == 503 and body["status"] == "stopped"
        status, _, body = _complete(srv)
        assert status == 503, body
    finally:
        srv.stop()


def test_beyond_max_queue_http_gets_429_and_admitted_requests_complete(tmp_path_factory):
    srv = _server(tmp_path_factory, max_queue=1)
    try:
        solo = _tokens(srv, max_tokens=4)
        worker = srv.service.engine.program.worker.pid
        os.kill(worker, signal.SIGSTOP)  # hold the engine inside a call: nothing leaves the queue
        results = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, _tokens(srv, max_tokens=4)))
                   for k in ("running", "queued")]
        threads[0].start()
        assert wait_for(lambda: srv.service.engine.active_rows == 1)
        threads[1].start()
        assert wait_for(lambda: srv.service.engine._queued == 1)
        status, headers, body = _complete(srv)
        assert status == 429 and headers.get("Retry-After") == "1" and body["error"]["code"] == "queue_full"
        os.kill(worker, signal.SIGCONT)
        for thread in threads:
            thread.join(120)
        assert results == {"running": solo, "queued": solo}
    finally:
        srv.stop()


def test_a_flooded_lmtp_connection_does_not_starve_another_client(server):
    mine = 'GENERATE {"stream_id": "me", "prompt": [1, 5, 9], "max_tokens": 3, "temperature": 1.0, "seed": 3}'
    alone = _stream_tokens(asyncio.run(lmtp_exchange(server, [mine], lambda m: "me" in _finished(m), timeout=120)), "me")
    flood = [f'GENERATE {{"stream_id": {i}, "prompt": [1, 5, 9], "max_tokens": 20}}' for i in range(1000)]
    limit = server.service.lmtp_inflight

    async def main():
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "/lmtp") as flooder:
            await flooder.send_str("\n".join(flood))
            other = await lmtp_exchange(server, [mine], lambda m: "me" in _finished(m), timeout=120)
            finished = {}
            while len(finished) < len(flood):
                message = await asyncio.wait_for(flooder.receive(), 120)
                for line in message.data.splitlines():
                    for entry in json.loads(line.partition(" ")[2]):
                        if entry.get("finish_reason"):
                            finished[entry["stream_id"]] = entry
            return other, finished
    other, finished = asyncio.run(main())
    assert _stream_tokens(other, "me") == alone and len(alone) == 3
    served = [e for e in finished.values() if e.get("error") is None]
    refused = [e for e in finished.values() if "unfinished streams" in (e.get("error") or "")]
    # Lines are read in order and streams finish meanwhile, so a few more than `limit` get served.
    assert len(served) + len(refused) == len(flood) and limit <= len(served) < len(flood) // 2


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    service = server.service
    inside, release = threading.Event(), threading.Event()
    order = []

    class Gate:  # the tokenizer, holding a marked prompt inside encode until the test lets it go
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, text, **kwargs):
            if text.startswith("HUGE"):
                inside.set()
                release.wait(60)
                order.append("tokenized")
            return self.inner.encode(text, **kwargs)

    real = service.tokenizer
    service.tokenizer = Gate(real)
    try:
        done = []
        thread = threading.Thread(target=lambda: done.append(_post(server, "/v1/completions", {
            "prompt": "HUGE" + "x" * 100_000, "max_tokens": 1})))
        thread.start()
        assert inside.wait(60)
        status, _ = _health(server)  # answered while the prompt is still being tokenized
        order.append("health")
        release.set()
        thread.join(120)
    finally:
        service.tokenizer = real
    assert status == 200 and order == ["health", "tokenized"]
    assert done[0][0] in (200, 400)  # (a prompt longer than the context is a 400, not a hang)


def test_limits_on_prompt_size_and_unsupported_fields_are_named(server):
    big = "y" * (server.service.max_prompt_bytes + 1)
    status, _, body = _post(server, "/v1/completions", {"prompt": big, "max_tokens": 1})
    assert status == 413 and "max-prompt-bytes" in body["error"]["message"]
    for name, value in (("best_of", 2), ("echo", True), ("suffix", "x"), ("tools", [{"type": "function"}])):
        status, _, body = _complete(server, **{name: value})
        assert status == 400 and body["error"]["param"] == name, body
    status, _, body = _complete(server, best_of=1, echo=False)
    assert status == 200, body
    messages = asyncio.run(lmtp_exchange(server, ['GENERATE {"stream_id": NaN, "prompt": [1]}'], lambda m: m, timeout=120))
    assert messages[0][0] == "MSG" and "stream_id" in messages[0][1]["error"]
