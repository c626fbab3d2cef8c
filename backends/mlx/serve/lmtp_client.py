"""A small LMTP client for trying `etmlx serve` by hand.

Type a protocol line (`GENERATE {...}`, `SCORE {...}`, `MODEL_INFO {...}`), or a shortcut:
`1,2,3 max_tokens=8 temperature=0.7` (token ids), or with --tokenizer any text followed by
key=value options. Stream ids are numbered for you. Every line the server sends is printed;
with a tokenizer, each finished stream's text is printed too.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from backends.mlx.llm.decoder.prompt import encode_prompt

_TYPES = ("GENERATE", "SCORE", "MODEL_INFO")


def to_line(text: str, stream_id: int, tokenizer) -> str:
    if text.split(" ", 1)[0] in _TYPES:
        return text
    words, options = [], {}
    for word in text.split(" "):
        key, eq, value = word.partition("=")
        if eq and key.isidentifier():
            options[key] = json.loads(value) if value[:1] in "-0123456789[{tf" else value
        else:
            words.append(word)
    body = " ".join(words)
    if tokenizer is not None:
        prompt = encode_prompt(tokenizer, body)
    else:
        try:
            prompt = [int(t) for t in body.replace(",", " ").split()]
        except ValueError:
            raise ValueError("without --tokenizer, type token ids (1,2,3) or a protocol line") from None
    return "GENERATE " + json.dumps({"stream_id": stream_id, "prompt": prompt, **options})


async def _session(url: str, sends: list[str], tokenizer) -> int:
    tokens: dict = {}
    open_streams: set = set()
    scripted = bool(sends)
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        async def reader():
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                for line in message.data.splitlines():
                    print(line, flush=True)
                    kind, _, data = line.partition(" ")
                    if kind == "MSG":
                        open_streams.discard(json.loads(data).get("stream_id"))
                    if kind != "TOKEN":
                        continue
                    for entry in json.loads(data):
                        sid = entry.get("stream_id")
                        if entry.get("token") is not None:
                            tokens.setdefault(sid, []).append(entry["token"])
                        if entry.get("finish_reason"):
                            open_streams.discard(sid)
                            if tokenizer is not None:
                                print(f"[{sid}] {tokenizer.decode(tokens.get(sid, []))!r}", flush=True)
                if scripted and not open_streams:
                    return

        task = asyncio.create_task(reader())
        next_id = 1
        lines = sends or None
        loop = asyncio.get_running_loop()
        while True:
            if lines is not None:
                if not lines:
                    break
                text = lines.pop(0)
            else:
                text = await loop.run_in_executor(None, sys.stdin.readline)
                if not text:
                    break
            text = text.strip()
            if not text:
                continue
            try:
                line = to_line(text, next_id, tokenizer)
            except ValueError as exc:
                print(f"lmtp-client: {exc}", file=sys.stderr)
                continue
            next_id += 1
            try:
                open_streams.add(json.loads(line.partition(" ")[2]).get("stream_id"))
            except json.JSONDecodeError:
                pass  # sent as typed: the server answers with an error
            await ws.send_str(line)
        if scripted:
            await asyncio.wait_for(task, timeout=300)
        else:
            task.cancel()
    return 0


def main(url: str, sends: list[str], tokenizer_dir: str | None = None) -> int:
    tokenizer = None
    if tokenizer_dir and Path(tokenizer_dir).is_file():  # a .pte: the tokenizer stored inside it
        from backends.mlx.llm.decoder.meta import DecoderMeta
        from backends.mlx.llm.decoder.tokenizer_files import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir, DecoderMeta.load(tokenizer_dir))
        if tokenizer is None:
            raise ValueError(f"--tokenizer {tokenizer_dir}: the program has no tokenizer")
    elif tokenizer_dir:
        from transformers import AutoTokenizer

        from backends.mlx.llm.checkpoint_source import TOKENIZER_FILES, resolve_checkpoint

        tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(tokenizer_dir, flag="--tokenizer",
                                                                     files=TOKENIZER_FILES))
    return asyncio.run(_session(url, list(sends), tokenizer))
