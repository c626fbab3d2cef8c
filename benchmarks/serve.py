"""`etmlx bench serve`: aggregate tokens/s and time to first token for 1, 4 and 16 concurrent
streams against one server, and /health latency while it decodes.

Without --url it starts `etmlx serve` as a child process on a free port (default .pte: the tiny
random Llama of tiny_model.py exported with batch 16, cached in out/bench_serve/). Every stream
asks for exactly --max-tokens tokens (the end-of-sequence token is banned) with its own seed.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

_PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.", "Hello there! How are you today?",
            "A server loads a program once and answers many clients."]
DEFAULT_PTE = Path("out/bench_serve/tiny.pte")


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def _stream(http, url, model, i, max_tokens, eos_ids):
    body = {"model": model, "prompt": _PROMPTS[i % len(_PROMPTS)], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": 1000 + i, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -100 for t in eos_ids}}
    start = time.perf_counter()
    first, tokens = None, 0
    async with http.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"stream {i}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens, time.perf_counter() - start


def _health_poller(url: str, stop: threading.Event, latencies: list) -> None:
    """On its own thread with a blocking keep-alive connection, so the latency measured is the
    server's, not this process's event loop busy parsing 16 streams."""
    host, port = url.split("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    while not stop.is_set():
        start = time.perf_counter()
        connection.request("GET", "/health")
        connection.getresponse().read()
        latencies.append(time.perf_counter() - start)
        stop.wait(0.02)
    connection.close()


async def _run(url: str, streams, max_tokens: int) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        async with http.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        async with http.get(url + "/health") as response:
            await response.read()
        # eos ids are not in the OpenAI API; the LMTP MODEL_INFO has them
        async with http.ws_connect(url + "/lmtp") as ws:
            await ws.send_str('MODEL_INFO {"stream_id": 0}')
            eos_ids = json.loads((await ws.receive()).data.partition(" ")[2])["model_info"]["eos_token_ids"]
        await _stream(http, url, model, 0, 4, eos_ids)  # warm-up
        records = []
        for count in streams:
            stop, latencies = threading.Event(), []
            poller = threading.Thread(target=_health_poller, args=(url, stop, latencies), daemon=True)
            poller.start()
            start = time.perf_counter()
            results = await asyncio.gather(*[_stream(http, url, model, i, max_tokens, eos_ids) for i in range(count)])
            wall = time.perf_counter() - start
            stop.set()
            poller.join(timeout=60)
            ttfts = [r[0] for r in results]
            total = sum(r[1] for r in results)
            records.append({"streams": count, "tokens": total, "seconds": wall, "tokens_per_s": total / wall,
                            "ttft_p50_ms": 1e3 * _percentile(ttfts, 50), "ttft_p99_ms": 1e3 * _percentile(ttfts, 99),
                            "health_p50_ms": 1e3 * _percentile(latencies, 50),
                            "health_p99_ms": 1e3 * _percentile(latencies, 99),
                            "health_max_ms": 1e3 * max(latencies), "health_samples": len(latencies)})
        return records


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(pte: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                    os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "backends.mlx.cli.main", "serve", str(pte), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 900.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def main(pte=None, url=None, streams=(1, 4, 16), max_tokens: int = 32, json_path=None) -> int:
    if any(s < 1 for s in streams):
        raise ValueError(f"--streams must be positive counts, got {streams}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    process = None
    if url is None:
        if pte is None:
            pte = DEFAULT_PTE
            if not pte.is_file():
                from backends.mlx.llm.builtin.tiny_model import export_tiny

                print(f"exporting the tiny benchmark model to {pte} (once)", flush=True)
                export_tiny(pte, batch=16, max_seq_len=128)
        pte = Path(pte)
        if not pte.is_file():
            raise FileNotFoundError(f"{pte} does not exist")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        process = _start_server(pte, port)
    try:
        if process is not None:
            _wait_ready(url, process)
        records = asyncio.run(_run(url.rstrip("/"), streams, max_tokens))
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    print(f"{'streams':>7} {'tokens':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'/health p50':>11} "
          f"{'p99':>7} {'max':>7}")
    for r in records:
        print(f"{r['streams']:>7} {r['tokens']:>7} {r['tokens_per_s']:>8.1f} {r['ttft_p50_ms']:>7.1f}ms "
              f"{r['ttft_p99_ms']:>7.1f}ms {r['health_p50_ms']:>9.2f}ms {r['health_p99_ms']:>5.2f}ms "
              f"{r['health_max_ms']:>5.2f}ms")
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1) + "\n")
    return 0
