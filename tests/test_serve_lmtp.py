"""LMTP on the server: WebSocket /lmtp and TCP lines; interleaved GENERATE streams, SCORE,
MODEL_INFO, errors as messages on a connection that stays open; and `etmlx lmtp-client`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from backends.mlx.serve.app import ServerThread
from serve_helpers import bit_exact_batching, BATCH, MAX_SEQ_LEN, eager_greedy, eager_model, eager_scores, tiny_pte

pytestmark = pytest.mark.server  # a server on a thread

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with bit_exact_batching():
        srv = ServerThread(tiny_pte(tmp_path_factory), model_name="tiny", lmtp_port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def eager():
    return eager_model()


class Conversation:
    """Lines out, lines in, over one WebSocket; tokens collected per stream."""

    def __init__(self, ws):
        self.ws = ws
        self.messages: list[tuple[str, object]] = []
        self.tokens: dict = {}
        self.finished: dict = {}
        self.token_messages = 0
        self.mixed = 0  # TOKEN messages that carried more than one stream

    async def send(self, kind: str, data) -> None:
        await self.ws.send_str(f"{kind} {data if isinstance(data, str) else json.dumps(data)}")

    async def until(self, done, timeout=120.0):
        async def loop():
            while not done():
                message = await self.ws.receive()
                assert message.type == aiohttp.WSMsgType.TEXT, message
                for line in message.data.splitlines():
                    kind, _, data = line.partition(" ")
                    payload = json.loads(data)
                    self.messages.append((kind, payload))
                    if kind == "TOKEN":
                        self.token_messages += 1
                        self.mixed += len({e["stream_id"] for e in payload}) > 1
                        for entry in payload:
                            sid = entry["stream_id"]
                            if entry.get("token") is not None:
                                self.tokens.setdefault(sid, []).append(entry)
                            if entry.get("finish_reason"):
                                self.finished[sid] = entry
        await asyncio.wait_for(loop(), timeout)


def _talk(server, script):
    async def main():
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "/lmtp") as ws:
            return await script(Conversation(ws))
    return asyncio.run(main())


def test_model_info(server):
    async def script(c):
        await c.send("MODEL_INFO", {"stream_id": 1})
        await c.until(lambda: c.messages)
        return c.messages[0]

    kind, payload = _talk(server, script)
    assert kind == "MSG" and payload["stream_id"] == 1
    info = payload["model_info"]
    assert info["model"] == "tiny" and info["max_seq_len"] == MAX_SEQ_LEN and info["batch"] == BATCH
    assert info["score"] is True and "top_k" in info["sampler"]


def _generate(sid, prompt, **kw):
    return {"stream_id": sid, "prompt": prompt, "max_tokens": 10, **kw}


def test_interleaved_streams_equal_their_alone_results(server):
    # Stream 1 runs 40 steps, so the others join it even when a loaded machine delays their GENERATE messages by
    # several engine steps (with 10 it once finished alone under the full test suite: no shared TOKEN message).
    requests = [_generate(1, [5, 6, 7], temperature=1.0, seed=4, logit_bias={"0": -100}, max_tokens=40),
                _generate(2, list(range(10, 40)), temperature=0.8, top_k=10, seed=9, max_tokens=14,
                          logit_bias={"0": -100}),
                _generate("c", [3], logit_bias={"0": -100}, max_tokens=6)]

    async def alone(c):
        out = {}
        for r in requests:
            await c.send("GENERATE", r)
            await c.until(lambda: r["stream_id"] in c.finished)
            out[r["stream_id"]] = [(e["token"], e["logprob"]) for e in c.tokens[r["stream_id"]]]
        return out

    async def together(c):
        for r in requests:
            await c.send("GENERATE", r)
        await c.until(lambda: len(c.finished) == len(requests))
        return {sid: [(e["token"], e["logprob"]) for e in entries] for sid, entries in c.tokens.items()}, c

    expected = _talk(server, alone)
    got, conversation = _talk(server, together)
    assert got == expected
    assert [len(expected[r["stream_id"]]) for r in requests] == [40, 14, 6]
    assert all(c["finish_reason"] == "length" for c in conversation.finished.values())
    assert conversation.mixed >= 1  # tokens of different streams shared TOKEN messages
    first = conversation.tokens[1][0]
    assert set(first) == {"token", "stream_id", "logprob", "finish_reason", "top_logprobs"}
    assert max(first["top_logprobs"].values()) >= first["logprob"]


def test_score_gives_the_eager_logprobs_of_the_scored_tokens(server, eager):
    model, _ = eager
    prompt, scored = [5, 6, 7, 8], [9, 44, 2, 200, 17]

    async def script(c):
        await c.send("SCORE", {"stream_id": 7, "prompt": prompt, "scored": scored})
        await c.until(lambda: 7 in c.finished)
        return c.tokens[7]

    entries = _talk(server, script)
    assert [e["token"] for e in entries] == scored
    assert [e["logprob"] for e in entries] == pytest.approx(eager_scores(model, prompt, scored), abs=1e-4)
    assert all("top_logprobs" not in e for e in entries)
    assert entries[-1]["finish_reason"] == "length"


def test_greedy_generate_matches_eager(server, eager):
    model, _ = eager
    prompt = [11, 12, 13]

    async def script(c):
        await c.send("GENERATE", _generate(1, prompt, max_tokens=8, logit_bias={"0": -100}))
        await c.until(lambda: 1 in c.finished)
        return [(e["token"], e["logprob"]) for e in c.tokens[1]]

    got = _talk(server, script)
    expected = eager_greedy(model, prompt, 8, banned=0)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def test_errors_are_messages_and_the_connection_stays(server):
    async def script(c):
        await c.ws.send_str("this is not a message")
        await c.send("GENERATE", "{broken json")
        await c.send("GENERATE", {"prompt": [1, 2]})  # no stream id
        await c.send("GENERATE", _generate(5, [1, 2], temperature=-1))
        await c.send("GENERATE", _generate(6, [1, 2], max_tokens=MAX_SEQ_LEN))
        await c.send("SCORE", {"stream_id": 8, "prompt": [1], "scored": []})
        await c.send("GENERATE", _generate(10, [1, 2], top_logprobs=10 ** 6))
        await c.send("GENERATE", _generate(11, [1, 2], max_tokens=2, top_logprobs=1))
        await c.send("GENERATE", _generate(9, [1, 2, 3], max_tokens=3))  # still served
        await c.until(lambda: 9 in c.finished and 11 in c.finished and len(c.messages) >= 8)
        return c

    c = _talk(server, script)
    errors = [(kind, p) for kind, p in c.messages if kind == "MSG" and p.get("error")]
    assert len(errors) == 3 and all(p["stream_id"] is None for _, p in errors)
    assert "unknown message type" in errors[0][1]["error"] and "not valid JSON" in errors[1][1]["error"]
    assert "stream_id" in errors[2][1]["error"]
    assert "'top_logprobs' is 1000000 but this program returns at most" in c.finished[10]["error"]
    assert all(len(e["top_logprobs"]) == 1 for e in c.tokens[11])  # fewer than the program's, as asked
    for sid, word in ((5, "temperature"), (6, "max_seq_len"), (8, "scored")):
        assert c.finished[sid]["finish_reason"] == "error" and word in c.finished[sid]["error"]
    assert len(c.tokens[9]) == 3 and c.finished[9]["finish_reason"] in ("stop", "length")


def test_closing_the_socket_cancels_its_streams(server):
    async def script(c):
        for sid in range(3):
            await c.send("GENERATE", _generate(sid, [1, 2, 3], max_tokens=50, temperature=1.0, seed=sid,
                                               logit_bias={"0": -100}))
        await c.until(lambda: len(c.tokens) >= 1)

    _talk(server, script)
    engine = server.service.engine
    for _ in range(600):
        if engine.active_rows == 0 and engine.waiting == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert (engine.active_rows, engine.waiting) == (0, 0)


def test_tcp_lines(server):
    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.server.lmtp_port)
        writer.write(b'MODEL_INFO {"stream_id": 1}\nnonsense\nGENERATE {"stream_id": 2, "prompt": [4, 5], '
                     b'"max_tokens": 4, "logit_bias": {"0": -100}}\n')
        await writer.drain()
        lines, tokens = [], []
        while not any(t.get("finish_reason") for t in tokens):
            line = (await asyncio.wait_for(reader.readline(), 120)).decode()
            lines.append(line)
            if line.startswith("TOKEN "):
                tokens += json.loads(line[6:])
        writer.close()
        return lines, tokens

    lines, tokens = asyncio.run(main())
    assert any(line.startswith("MSG ") and "model_info" in line for line in lines)
    assert any(line.startswith("MSG ") and "unknown message type" in line for line in lines)
    assert [t["stream_id"] for t in tokens] == [2] * 4


def test_lmtp_client_command(server):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "lmtp-client", "--url",
                           server.url.replace("http", "ws") + "/lmtp", "--send", "4,5,6 max_tokens=3",
                           "--send", 'MODEL_INFO {"stream_id": 99}'],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    tokens = [e for line in done.stdout.splitlines() if line.startswith("TOKEN ") for e in json.loads(line[6:])]
    assert [t["stream_id"] for t in tokens if t.get("token") is not None] == [1] * len(tokens) and tokens
    assert any(line.startswith("MSG ") and '"stream_id": 99' in line for line in done.stdout.splitlines())


def test_lmtp_client_takes_the_tokenizer_from_the_pte(server, tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "lmtp-client", "--url",
                           server.url.replace("http", "ws") + "/lmtp", "--tokenizer", str(tiny_pte(tmp_path_factory)),
                           "--send", "Hello there max_tokens=3"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    _, tokenizer = eager_model()
    tokens = [e["token"] for line in done.stdout.splitlines() if line.startswith("TOKEN ")
              for e in json.loads(line[6:]) if e.get("token") is not None]
    assert len(tokens) == 3 and f"[1] {tokenizer.decode(tokens)!r}" in done.stdout.splitlines()
