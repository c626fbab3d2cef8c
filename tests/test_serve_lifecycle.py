"""`etmlx serve` as a process: it answers on its port, and SIGTERM / SIGINT end in-flight streams
properly (a final chunk with finish_reason "abort", then [DONE]) and exit with status 0. Also the
benchmark's client against a running server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks import serve as bench_serve
from backends.mlx.llm.builtin.tiny_model import export_tiny
from serve_helpers import BATCH, tiny_pte

pytestmark = [pytest.mark.server, pytest.mark.subprocess]  # etmlx serve as a process

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pte(tmp_path_factory):
    return tiny_pte(tmp_path_factory)


# Streams long enough that no row can finish before the signal reaches the server, even on a loaded machine
# (the shared tiny program's 64 positions leave ~60 tokens: ~0.1 s; its model has 512 positions). 480 tokens of
# the 2-layer, 64-wide model (~0.2 s) lost that race in a loaded suite run once decoding got faster (mimalloc), so
# the long program's model is wider and deeper (LONG_MODEL): each token costs several times more. The C++ cache
# write stopped copying the cache each step (backend.cpp) and lost the race again (1 run in 3): 4x the layers.
LONG_TOKENS = 480
LONG_MODEL = {"hidden": 256, "layers": 24}


@pytest.fixture(scope="module")
def long_pte(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "tiny.pte"  # the server serves it as "tiny"
    export_tiny(path, batch=BATCH, max_seq_len=LONG_TOKENS + 32, **LONG_MODEL)
    return path


def _start(pte, port):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "backends.mlx.cli.main", "serve", str(pte), "--port", str(port),
                                "--max-batch", "2"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        try:
            return process, json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read())
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("the server did not come up")


def _stream_head(port: int) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": LONG_TOKENS, "temperature": 1.0, "seed": 2,
                       "stream": True, "logit_bias": {"0": -100}}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def _until_data(sock) -> bytes:
    data = b""
    while b"data: " not in data:
        part = sock.recv(65536)
        assert part, data
        data += part
    return data


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_aborts_streams_and_exits_cleanly(long_pte, sig):
    port = _free_port()
    process, health = _start(long_pte, port)
    try:
        assert health["status"] == "ok"
        socks = [_stream_head(port) for _ in range(3)]  # 2 rows: one request waits
        received = [_until_data(s) for s in socks[:2]]  # both rows are streaming
        process.send_signal(sig)
        for sock, head in zip(socks, received + [b""]):
            data = head
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                data += part
            assert b'"finish_reason": "abort"' in data and b"data: [DONE]" in data, data[-300:]
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_bench_client_counts_tokens_against_a_running_server(pte):
    from backends.mlx.serve.app import ServerThread

    srv = ServerThread(pte, model_name="tiny").start()
    try:
        records = asyncio.run(bench_serve._run(srv.url, (1, 3), 5))
    finally:
        srv.stop()
    assert [r["streams"] for r in records] == [1, 3] and [r["tokens"] for r in records] == [5, 15]
    assert all(r["health_samples"] >= 1 and r["ttft_p50_ms"] > 0 for r in records)


@pytest.mark.parametrize("extra, message", [(["--max-batch", "9"], "--max-batch must be in [1, 4]"),
                                            (["--max-batch", "0"], "--max-batch must be in [1, 4]")])
def test_serve_rejects_a_bad_max_batch(pte, extra, message):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "serve", str(pte), *extra], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_serve_names_a_missing_pte(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "serve", str(tmp_path / "none.pte")], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "none.pte does not exist" in done.stderr
