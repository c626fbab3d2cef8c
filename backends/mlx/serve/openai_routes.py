"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Each choice (n) is its own engine row. A choice that hits a stop string is cancelled in the engine
at once; a client that goes away mid-request cancels all its rows (the write fails, or aiohttp
cancels the handler). OpenAI's `prediction` (Predicted Outputs) gives each row of a draft-verifying
program its own PredictionDraft; a plain program serves it without drafts (usage counts 0).
Chat `image_url` parts (serve/image_parts.py) become {"type": "image"} parts and the rows' `images`; a program
that takes no images refuses them (400).
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from backends.mlx.llm.decoder.draft_sources import PredictionDraft
from backends.mlx.serve import openai_format as fmt
from backends.mlx.serve.api_errors import ApiError
from backends.mlx.serve.choice_text import ChoiceText, Piece
from backends.mlx.serve.engine import QueueFull
from backends.mlx.serve.image_parts import image_parts
from backends.mlx.serve.openai_params import (Job, build_job, chat_prompt, check_model, check_unsupported,
                                              completion_prompt, prediction_text, prediction_tokens,
                                              prompt_text_bytes)
from backends.mlx.serve.service import PromptTooLarge, Service
from backends.mlx.serve.structured_params import constraint_from_body, structured_rows
from backends.mlx.serve.tool_params import tool_request, tool_rows
from backends.mlx.serve.tool_stream import delta_calls, message_calls, tool_pieces

_STARTED = int(time.time())


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


async def _body(request: web.Request, service: Service) -> dict:
    # read here, parsed off the event loop when large (serve/body_parse.py)
    body = await service.bodies.parse(await request.read(), ApiError)
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


class OpenAIRoutes:
    def __init__(self, service: Service):
        self.service = service
        self.token_text = fmt.TokenText(service.tokenizer)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        meta = self.service.meta
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": _STARTED, "owned_by": "etmlx", "max_model_len": meta.max_seq_len}
            # each switchable adapter as a model of its own, BASE:NAME
            for name in [self.service.model_name] + [f"{self.service.model_name}:{a}" for a in meta.adapters]]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        service = self.service
        try:
            body = await _body(request, service)
            adapter = check_model(body, service.model_name, service.meta)
            check_unsupported(body)
            sources, images = [], []
            if chat:  # image_url parts: counted here, decoded below once the cheap checks pass (serve/image_parts.py)
                messages, sources = image_parts(body.get("messages"))
                service.images.check_count(len(sources), service.model_name)
            tools = tool_request(body, chat, service)  # serve/tool_params.py
            predicted = prediction_text(body)
            service.check_prompt_size(prompt_text_bytes(body, chat) + len((predicted or "").encode("utf-8")))
            if sources:  # off the event loop, a few at a time
                images = await service.images.decode(sources)
                body = {**body, "messages": messages}
            # Templating and tokenizing a large prompt take a while: off the event loop.
            prompt = await (service.off_loop(chat_prompt, body, service.tokenizer, tools, service.meta, images) if chat
                            else service.off_loop(completion_prompt, body, service.tokenizer, service.meta))
            job = build_job(body, service.meta, prompt, chat=chat)
            job.images = images
            if predicted is not None:
                job.prediction = await service.off_loop(prediction_tokens, predicted, service.tokenizer, service.meta)
            parses = tools is not None and tools.parses  # markers are special tokens: keep their text
            texts = [ChoiceText(service.tokenizer, prompt, job.stops, service.meta.eos_token_ids, keep_special=parses)
                     for _ in job.choices]
            constraint = constraint_from_body(body)
            # compiled off the event loop, in a bounded worker first (serve/grammar_compiler.py): one per row
            extras = (await tool_rows(service, tools, len(job.choices), constraint is not None)
                      or await structured_rows(service, constraint, len(job.choices), body))
            if job.prediction is not None:  # each row its own source: it follows its own output
                extras = [{**extra, "draft": PredictionDraft(job.prediction)} for extra in extras]
            if images:
                extras = [{**extra, "images": images} for extra in extras]
            if adapter:
                extras = [{**extra, "adapter": adapter} for extra in extras]
            rows = [(prompt, params, job.max_tokens, extra) for params, extra in zip(job.choices, extras)]
            events = service.stream_rows(rows, list(range(len(rows))))
            first = await _first(events)  # submission errors surface here, before any response starts
        except ApiError as error:
            return error_response(error)
        except PromptTooLarge as exc:
            return error_response(ApiError(str(exc), status=413, param="messages" if chat else "prompt"))
        except QueueFull as exc:
            return error_response(ApiError(str(exc), status=429, type="rate_limit_error", code="queue_full",
                                           headers={"Retry-After": "1"}))
        except (ValueError, TypeError) as exc:
            return error_response(ApiError(str(exc)))
        except RuntimeError as exc:  # the engine stopped (shutting down)
            return error_response(ApiError(str(exc), status=503, type="server_error"))
        pieces = self._pieces(first, events, texts)
        if parses:
            pieces = tool_pieces(pieces, tools, len(texts))
        if job.stream:
            return await self._stream(request, job, chat, pieces, texts)
        return await self._collect(job, chat, pieces, texts)

    async def _pieces(self, first, events, texts):
        async def all_events():
            if first is not None:
                yield first
            async for item in events:
                yield item
        try:
            async for index, event, request_id in all_events():
                piece = texts[index].feed(event)
                if piece.finish_reason and event.finish_reason is None:  # a stop string: free the row now
                    self.service.cancel(request_id)
                yield index, piece
                if all(t.finished for t in texts):
                    return
        finally:
            await events.aclose()

    def _choice(self, job: Job, chat: bool, index: int, piece: Piece, offset: int, stream: bool) -> dict:
        logprobs = None
        if job.logprobs is not None and (piece.tokens or not stream):
            logprobs = (fmt.chat_logprobs(piece.tokens, job.logprobs, self.token_text) if chat else
                        fmt.completion_logprobs(piece.tokens, job.logprobs, self.token_text, offset))
        if chat:
            key = "delta" if stream else "message"
            message = {"content": piece.text} if stream else {"role": "assistant", "content": piece.text}
            if piece.tool_calls and not stream:  # OpenAI: no content beside calls is null
                message.update(content=piece.text if piece.text.strip() else None,
                               tool_calls=message_calls(piece.tool_calls))
            return {"index": index, key: message, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        return {"index": index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}

    async def _collect(self, job, chat, pieces, texts) -> web.Response:
        merged = [Piece() for _ in texts]
        async for index, piece in pieces:
            merged[index].text += piece.text
            merged[index].tokens += piece.tokens
            merged[index].finish_reason = piece.finish_reason
            merged[index].tool_calls += piece.tool_calls
            if piece.error and not merged[index].error:
                merged[index].error, merged[index].client_error = piece.error, piece.client_error
        failed = [p for p in merged if p.error]
        if failed:
            return error_response(_generation_error(failed[0]))
        choices = [self._choice(job, chat, i, p, 0, stream=False) for i, p in enumerate(merged)]
        kind = "chat.completion" if chat else "text_completion"
        return web.json_response(fmt.envelope(kind, fmt.new_id("chatcmpl" if chat else "cmpl"),
                                              self.service.model_name, choices,
                                              usage=self._usage(job, texts)))

    def _usage(self, job, texts) -> dict:
        prediction = None
        if job.prediction is not None:  # drafts of a plain program: none (0, 0)
            proposed, accepted = (sum(t.drafts[i] for t in texts) for i in (0, 1))
            prediction = (accepted, proposed - accepted)
        return fmt.usage(len(job.prompt), sum(t.completion_tokens for t in texts), texts[0].cached_tokens,
                         prediction)

    async def _stream_calls(self, response, chunk, job, index: int, piece: Piece, offset: int) -> None:
        finish, piece.finish_reason = piece.finish_reason, None
        if piece.text or piece.tokens:
            await response.write(chunk([self._choice(job, True, index, piece, offset, stream=True)]))
        for calls in delta_calls(piece.tool_calls):
            await response.write(chunk([{"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                         "finish_reason": None}]))
        if finish:
            await response.write(chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]))

    async def _stream(self, request, job, chat, pieces, texts) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        rid = fmt.new_id("chatcmpl" if chat else "cmpl")
        model = self.service.model_name
        offsets = [0] * len(texts)

        def chunk(choices, **extra):
            return fmt.sse(fmt.envelope(kind, rid, model, choices, **extra))

        try:
            if chat:  # the role comes first, as OpenAI sends it
                await response.write(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None} for i in range(len(texts))]))
            async for index, piece in pieces:
                if piece.error:
                    await response.write(fmt.sse(_generation_error(piece).body()))
                if not (piece.text or piece.tokens or piece.finish_reason or piece.tool_calls):
                    continue
                if piece.tool_calls:  # the content before the calls, each call (its name, then its arguments), the end
                    await self._stream_calls(response, chunk, job, index, piece, offsets[index])
                else:
                    await response.write(chunk([self._choice(job, chat, index, piece, offsets[index], stream=True)]))
                offsets[index] += len(piece.text)
            if job.include_usage:
                await response.write(chunk([], usage=self._usage(job, texts)))
            await response.write(fmt.DONE)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client left; closing `pieces` (below) cancels its rows
        finally:
            await pieces.aclose()
        return response


def _generation_error(piece: Piece) -> ApiError:
    """A choice that ended with an error: the request's own grammar failing is the client's (400), the
    rest is the server's (500)."""
    if piece.client_error:
        return ApiError(f"the request's grammar failed during generation: {piece.error}")
    return ApiError(f"generation failed: {piece.error}", status=500, type="server_error")


async def _first(events):
    """The first event (which makes the generator submit its requests and raise submission errors)."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
