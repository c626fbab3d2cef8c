"""One LMTP connection: lines `TYPE JSON` in, `TOKEN [...]` and `MSG {...}` lines out.

In:  GENERATE {"stream_id", "prompt": [ids] or "text", "max_tokens", "top_logprobs" (0..the program's
               --logprobs; more is an error naming the limit; absent: all of them), and the knobs of
               llm/sampler/knobs.py by name: "temperature", "seed", "top_k", "top_p", "min_p",
               "logit_bias": {"id": bias}, "presence_penalty", "frequency_penalty",
               "repetition_penalty"}                          (every knob defaults to off: greedy)
              text is tokenized as everywhere else (llm/decoder/prompt.py: BOS as the tokenizer says)
              "response_format" / "structured_outputs", and "tools" / "tool_choice" / "parallel_tool_calls" as in
              /v1/chat/completions: the tokens follow the call syntax (MODEL_INFO's tool_call_format) and
              the client, which renders the prompt, parses the calls
              "images": [URL, ...] for a vision-language program: data:image/...;base64, URLs (local files as
              `--allow-local-images` allows; serve/image_parts.py), in the order of the image placeholders the
              prompt holds (the client renders the prompt: its placeholders are the chat template's); a program
              that takes no images refuses them; MODEL_INFO's "max_images" says how many (0: none)
     SCORE    {"stream_id", "prompt": [ids], "scored": [ids]}  logprob of each scored token
     GENERATE and SCORE take "model": "BASE:NAME" or "adapter": "NAME" to run on a switchable LoRA adapter
              (MODEL_INFO's adapters); an unknown name is a stream error
     MODEL_INFO {"stream_id"}
Out: TOKEN [{"token", "stream_id", "logprob", "finish_reason", "top_logprobs": {"id": lp}}, ...]
     carries every token that arrived since the last send, of all streams interleaved (order
     within a stream kept); a stream's last token has a finish_reason. SCORE tokens have no
     top_logprobs. A stream that fails gets TOKEN [{"stream_id", "error", "finish_reason": "error"}];
     a line that names no usable stream gets MSG {"stream_id": null, "error"}. The connection stays.
     MSG {"stream_id", "model_info": {...}} answers MODEL_INFO.
Limits: at most `service.lmtp_inflight` unfinished streams per connection, the engine's queue
(a full one is a stream error saying so) and the prompt size; text prompts are tokenized off the
event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Awaitable, Callable

from backends.mlx.llm.decoder.prompt import encode_prompt
from backends.mlx.llm.decoder.tool_calls import tool_format
from backends.mlx.llm.sampler.knobs import USER_KNOBS, enabled
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.api_errors import ApiError
from backends.mlx.serve.engine import EngineRequest, TokenEvent
from backends.mlx.serve.image_parts import generate_sources
from backends.mlx.serve.json_text import parse_json_text
from backends.mlx.serve.openai_params import check_model
from backends.mlx.serve.structured_params import constraint_from_body, structured_rows
from backends.mlx.serve.tool_params import tool_request, tool_rows
from backends.mlx.serve.service import Service, queue_sink

log = logging.getLogger("etmlx.serve")


class LmtpError(ValueError):
    pass


def generate_params(payload: dict) -> SamplingParams:
    """The knobs of the table a GENERATE line sets (by their names; the rest stay off). SamplingParams
    checks the values; whether the program has each knob is checked when the engine takes it."""
    knobs = {k.name: payload[k.name] for k in USER_KNOBS if payload.get(k.name) is not None}
    for knob in USER_KNOBS:
        if knob.width and knob.name in knobs:  # token id -> value: JSON keys are strings
            if not isinstance(knobs[knob.name], dict):
                raise LmtpError(f"'{knob.name}' must be an object of token id -> value")
            try:
                knobs[knob.name] = {int(key): v for key, v in knobs[knob.name].items()}
            except (TypeError, ValueError):
                raise LmtpError(f"'{knob.name}' keys must be token ids") from None
    return SamplingParams(**knobs)


def _top_logprobs(value, limit: int) -> int | None:
    """GENERATE's top_logprobs: None (all the program returns) or 0..limit; more is an error naming the
    limit rather than silently fewer alternatives."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LmtpError(f"'top_logprobs' must be an integer >= 0, got {value!r}")
    if value > limit:
        raise LmtpError(f"'top_logprobs' is {value} but this program returns at most {limit} alternatives "
                        f"(exported with --logprobs {limit})")
    return value


def _ids(value, name: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise LmtpError(f"'{name}' must be a list of token ids")
    if any(not 0 <= t < vocab for t in value):
        raise LmtpError(f"'{name}' token ids must be in [0, {vocab})")
    return value


def prompt_ids(value, tokenizer, vocab: int) -> list[int]:
    """GENERATE's prompt: token ids as they are, or text tokenized by the rule every path uses."""
    if not isinstance(value, str):
        return _ids(value, "prompt", vocab)
    if tokenizer is None:
        raise LmtpError("this .pte has no tokenizer: send the prompt as token ids")
    ids = encode_prompt(tokenizer, value)
    if not ids:
        raise LmtpError("the prompt is empty")
    return ids


class LmtpSession:
    def __init__(self, service: Service, send: Callable[[str], Awaitable[None]]):
        self.service = service
        self.send = send
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.streams: dict[object, tuple[int, bool]] = {}  # stream_id -> (engine request id, scoring)
        self.top: dict[object, int] = {}  # stream_id -> the top_logprobs it asked for (absent: all the program has)
        self.sender = asyncio.create_task(self._send_tokens())

    async def handle_line(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        kind, _, data = line.partition(" ")
        handler = {"GENERATE": self._generate, "SCORE": self._score, "MODEL_INFO": self._model_info}.get(kind)
        if handler is None:
            return await self._message(None, error=f"unknown message type {kind[:40]!r} (GENERATE, SCORE, "
                                                   "MODEL_INFO)")
        try:
            payload = parse_json_text(data, f"the data after {kind}", LmtpError) if data.strip() else {}
        except LmtpError as exc:
            return await self._message(None, error=f"malformed line: {exc}")
        if not isinstance(payload, dict):
            return await self._message(None, error=f"malformed line: {kind} takes a JSON object")
        stream_id = payload.get("stream_id")
        if (stream_id is None or isinstance(stream_id, (bool, dict, list))
                or isinstance(stream_id, float) and not math.isfinite(stream_id)):
            return await self._message(None, error=f"{kind} needs a 'stream_id' (an int or a string)")
        try:
            await handler(stream_id, payload)
        except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: queue full, engine stopped
            await self._stream_error(stream_id, str(exc))

    async def _model_info(self, stream_id, payload) -> None:
        meta, config = self.service.meta, self.service.meta.config
        await self._message(stream_id, model_info={
            "model": self.service.model_name, "max_seq_len": meta.max_seq_len, "vocab_size": meta.vocab_size,
            "batch": self.service.engine.usable, "eos_token_ids": meta.eos_token_ids, "model_type": meta.model_type,
            "logprobs": config.logprobs, "sampler": [i.name for k in USER_KNOBS if k.feature and enabled(k, config)
                                                       for i in k.program_inputs],
            "score": bool(config.logprobs and config.logprobs_mode == "raw" and config.logit_bias),
            "tool_call_format": tool_format(meta, self.service.tokenizer), "adapters": list(meta.adapters),
            "max_images": self.service.images.max_images if self.service.images.takes_images else 0})

    def _check_new(self, stream_id, payload) -> int:
        """Checks a new stream; its adapter index (0: the base model)."""
        if stream_id in self.streams:
            raise LmtpError(f"stream {stream_id!r} is still running")
        if len(self.streams) >= self.service.lmtp_inflight:
            raise LmtpError(f"this connection has {len(self.streams)} unfinished streams (the limit): wait for one "
                            "to finish")
        model = payload.get("model")
        if model == "":
            payload = {**payload, "model": None}
        try:  # "model": "BASE:NAME" or "adapter": "NAME" picks a switchable adapter, as the OpenAI endpoints take it
            return check_model(payload, self.service.model_name, self.service.meta)
        except ApiError as exc:
            if exc.status == 404:
                raise LmtpError(f"unknown model {model!r}: this server serves {self.service.model_name!r}") from None
            raise LmtpError(exc.message) from None

    async def _generate(self, stream_id, payload) -> None:
        adapter = self._check_new(stream_id, payload)
        meta = self.service.meta
        text = payload.get("prompt")
        if isinstance(text, str):
            try:
                self.service.check_prompt_size(len(text.encode("utf-8")))
            except UnicodeEncodeError as exc:
                raise LmtpError(f"the prompt is not valid Unicode (a lone surrogate at character {exc.start})") \
                    from None
        try:  # images: counted here, decoded off the event loop (serve/image_parts.py)
            sources = generate_sources(payload.get("images"))
            self.service.images.check_count(len(sources), self.service.model_name)
            images = await self.service.images.decode(sources) if sources else []
        except ApiError as exc:
            raise LmtpError(exc.message) from None
        # Tokenizing a large text prompt takes a while: off the event loop.
        prompt = await self.service.off_loop(prompt_ids, text, self.service.tokenizer, meta.vocab_size)
        params = generate_params(payload)
        top = _top_logprobs(payload.get("top_logprobs"), meta.config.logprobs)
        try:  # response_format / structured_outputs, tools, as the OpenAI endpoints take them; compiled off the loop
            constraint = constraint_from_body(payload)
            tools = tool_request({**payload, "messages": None}, True, self.service)  # the prompt is the client's
            rows = await tool_rows(self.service, tools, 1, constraint is not None)
            (extra,) = rows or await structured_rows(self.service, constraint, 1, payload)
        except ApiError as exc:
            raise LmtpError(exc.message) from None
        room = meta.max_seq_len - len(prompt)
        max_tokens = payload.get("max_tokens", max(1, min(32, room)))  # a too-long prompt is reported as such
        self._submit(stream_id, EngineRequest(prompt, params, max_tokens, queue_sink(self.loop, self.events,
                                                                                     stream_id), images=images,
                                              **extra, adapter=adapter), scoring=False)
        if top is not None:
            self.top[stream_id] = top

    async def _score(self, stream_id, payload) -> None:
        adapter = self._check_new(stream_id, payload)
        meta = self.service.meta
        prompt = _ids(payload.get("prompt"), "prompt", meta.vocab_size)
        scored = _ids(payload.get("scored"), "scored", meta.vocab_size)
        if not scored:
            raise LmtpError("'scored' is empty: give the tokens to score")
        request = EngineRequest(prompt, SamplingParams(), len(scored), queue_sink(self.loop, self.events, stream_id),
                                stop_at_eos=False, forced=list(scored), adapter=adapter)
        self._submit(stream_id, request, scoring=True)

    def _submit(self, stream_id, request: EngineRequest, scoring: bool) -> None:
        self.service.engine.submit(request)  # raises ValueError/TypeError for what the program cannot do
        self.streams[stream_id] = (request.id, scoring)

    async def _message(self, stream_id, **fields) -> None:
        await self.send("MSG " + json.dumps({"stream_id": stream_id, **fields}))

    async def _stream_error(self, stream_id, error: str) -> None:
        await self.send("TOKEN " + json.dumps([{"stream_id": stream_id, "error": error, "finish_reason": "error"}]))

    def _token(self, stream_id, event: TokenEvent) -> dict:
        _, scoring = self.streams.get(stream_id, (None, False))
        if event.token is None:  # ended without a token: cancelled, aborted or failed
            entry = {"stream_id": stream_id, "token": None, "finish_reason": event.finish_reason}
            if event.error:
                entry["error"] = event.error
            return entry
        entry = {"token": event.token, "stream_id": stream_id, "logprob": event.logprob,
                 "finish_reason": event.finish_reason}
        if not scoring and event.top is not None:
            top = self.top.get(stream_id, len(event.top))
            entry["top_logprobs"] = {str(i): lp for i, lp in event.top[:top]}
        return entry

    async def _send_tokens(self) -> None:
        while True:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            entries = [self._token(stream_id, event) for stream_id, event in batch]
            for stream_id, event in batch:
                if event.finish_reason:
                    self.streams.pop(stream_id, None)
                    self.top.pop(stream_id, None)
            try:
                await self.send("TOKEN " + json.dumps(entries))
            except (ConnectionError, RuntimeError):
                return

    async def close(self) -> None:
        """The connection ended: cancel its streams."""
        for request_id, _ in self.streams.values():
            self.service.engine.cancel(request_id)
        self.streams.clear()
        self.top.clear()
        self.sender.cancel()
        try:
            await self.sender
        except (asyncio.CancelledError, Exception):
            pass
