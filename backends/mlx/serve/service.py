"""What the request handlers share: the program's metadata, its tokenizer, the engine, and the
bridge from engine events (engine thread) to an asyncio queue (the handler's loop)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.body_parse import BodyParser
from backends.mlx.serve.engine import Engine, EngineRequest, TokenEvent
from backends.mlx.serve.grammar_compiler import GrammarCompiler
from backends.mlx.serve.image_parts import ImageInputs


class PromptTooLarge(ValueError):
    """A prompt over the server's --max-prompt-bytes (HTTP 413)."""


def queue_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, key):
    """A sink for the engine thread: the only safe way into an asyncio.Queue from another thread."""
    def sink(event: TokenEvent) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (key, event))
    return sink


@dataclass
class Service:
    meta: DecoderMeta
    tokenizer: object
    engine: Engine
    model_name: str
    max_prompt_bytes: int = 4 * 1024 * 1024  # prompt text of one request (UTF-8 bytes)
    lmtp_inflight: int = 8  # unfinished streams per LMTP connection
    grammar: GrammarCompiler | None = None  # structured output: request grammars to matchers, off the loop
    tool_requests: OrderedDict = field(default_factory=OrderedDict)  # recent checked tool fields (tool_params.py)
    bodies: BodyParser = field(default_factory=lambda: BodyParser(65_536))  # HTTP bodies to JSON, off the loop
    images: ImageInputs = field(default_factory=ImageInputs)  # what image input the program takes, from where

    async def stream_rows(self, requests: list[tuple[list[int], SamplingParams, int, dict]], keys: list
                          ) -> AsyncIterator[tuple[object, TokenEvent, int]]:
        """Submit one engine request per entry ((prompt, params, max_tokens, extra EngineRequest
        fields)) and yield (key, event, request id) as events arrive, until each has finished.
        Submission errors (ValueError/TypeError) propagate before anything runs. Leaving early
        (the consumer stops, or is cancelled because its client went away) cancels what is left."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        made = [EngineRequest(prompt, params, max_tokens, queue_sink(loop, queue, key), **extra)
                for (prompt, params, max_tokens, extra), key in zip(requests, keys)]
        ids = {key: request.id for key, request in zip(keys, made)}
        self.engine.submit_all(made)  # all or none: ValueError/TypeError, QueueFull
        live = set(keys)
        try:
            while live:
                key, event = await queue.get()
                if key not in live:
                    continue
                if event.finish_reason:
                    live.discard(key)
                yield key, event, ids[key]
        finally:
            for key in live:
                self.engine.cancel(ids[key])

    def check_prompt_size(self, text_bytes: int) -> None:
        """PromptTooLarge when a prompt's text exceeds max_prompt_bytes (before tokenizing it)."""
        if text_bytes > self.max_prompt_bytes:
            raise PromptTooLarge(f"the prompt is {text_bytes} bytes; this server takes at most {self.max_prompt_bytes} "
                                 "(etmlx serve --max-prompt-bytes)")

    async def off_loop(self, function, *args):
        """Run tokenization / templating of a request in a worker thread: a large prompt must not
        hold up the event loop (/health, other streams)."""
        return await asyncio.to_thread(function, *args)

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)
