"""Shared by the serving tests: one tiny decoder .pte per test session (exports are slow), a server
on a free loopback port, and the eager model the .pte was exported from."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import urllib.request

import torch

from backends.mlx.llm.builtin.tiny_model import export_tiny, tiny_llama, train_tokenizer
from run_once import exclusive, shared_dir

BATCH = 4
MAX_SEQ_LEN = 64


def tiny_pte(tmp_path_factory):
    """Exported once per run: the first caller exports (other xdist workers wait on the lock), later ones reuse it."""
    directory = shared_dir(tmp_path_factory, "serve_tiny")
    path = directory / "tiny.pte"
    with exclusive(directory):
        if not path.is_file():
            export_tiny(path, batch=BATCH, max_seq_len=MAX_SEQ_LEN)
    return path


def eager_model():
    tokenizer = train_tokenizer()
    return tiny_llama(len(tokenizer), tokenizer.eos_token_id), tokenizer


@torch.no_grad()
def eager_greedy(model, prompt: list[int], steps: int, banned: int | None = None):
    """Greedy ids and their raw logprobs from full forward passes (no cache)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        scores = logprobs.clone()
        if banned is not None:
            scores[banned] = -float("inf")
        token = int(scores.argmax())
        out.append((token, float(logprobs[token])))
        ids.append(token)
    return out


@torch.no_grad()
def eager_scores(model, prompt: list[int], scored: list[int]) -> list[float]:
    logprobs = torch.log_softmax(model(torch.tensor([prompt + scored])).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(scored)]


@contextlib.contextmanager
def bit_exact_batching():
    """Program workers started inside use MLX's reference BLAS (ETMLX_BLAS=reference).

    These tests compare a request's tokens and logprobs bit for bit alone and batched. OpenBLAS picks
    kernels by problem size, so with it a row of a product may round differently depending on how many
    rows share the call (the ~1-ulp logprob differences are documented in docs/serving.md); the reference
    BLAS sums in one fixed order, which is what makes the comparison exact."""
    before = os.environ.get("ETMLX_BLAS")
    os.environ["ETMLX_BLAS"] = "reference"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ETMLX_BLAS", None)
        else:
            os.environ["ETMLX_BLAS"] = before


async def lmtp_exchange(server, frames, until, timeout=60):
    """Send each of `frames` as one WebSocket TEXT frame to the server's /lmtp (bytes: sent as they are,
    even if not UTF-8); collect (kind, payload) messages until `until(messages)` holds."""
    import asyncio
    import json

    import aiohttp

    messages = []
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "/lmtp") as ws:
        for frame in frames:
            if isinstance(frame, bytes):
                await ws._writer.send_frame(frame, aiohttp.WSMsgType.TEXT)
            else:
                await ws.send_str(frame)

        async def read():
            while not until(messages):
                message = await ws.receive()
                assert message.type == aiohttp.WSMsgType.TEXT, message
                for line in message.data.splitlines():
                    kind, _, data = line.partition(" ")
                    messages.append((kind, json.loads(data)))
        await asyncio.wait_for(read(), timeout)
    return messages


def stream_in_thread(url: str, body: dict, events: list) -> threading.Thread:
    """POST a streamed completion (`body`) to `url` in a thread: `events` gets ("chunk", data) per chunk and finally
    ("end", the stream's error message or None)."""
    def run():
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        error = None
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        error = data["error"]["message"]
                    else:
                        events.append(("chunk", data))
        events.append(("end", error))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_for(condition, limit: float = 60.0) -> bool:
    """Whether `condition()` came true within `limit` seconds (polled every 20 ms)."""
    done = threading.Event()
    for _ in range(int(limit / 0.02)):
        if condition():
            return True
        done.wait(0.02)
    return False
