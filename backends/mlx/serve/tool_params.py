"""OpenAI's tool fields to a ToolRequest (llm/decoder/tool_calls.py), and a tool request's rows.

`tools` / `tool_choice` / `parallel_tool_calls`, and the legacy `functions` / `function_call` mapped onto the
same path. Each bad value is a 400 naming its field; the grammar (schemas over the limits, a strict schema
llguidance cannot enforce) is refused the same way, off the event loop, before anything runs. A program without
the allowed-token mask input (or a pipelined one) cannot constrain: "required" and a named function are then
refused, "auto" is parsed as written.
"""

from __future__ import annotations

import json

from backends.mlx.llm.decoder.constraints import EXPORT_HINT, ConstraintError
from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.llm.decoder.meta import PIPELINED_HINT
from backends.mlx.llm.decoder.tool_calls import ToolRequest, parse_tools, tool_format
from backends.mlx.llm.decoder.tool_formats import ToolError
from backends.mlx.llm.decoder.tool_prompt import has_tool_messages
from backends.mlx.serve.api_errors import ApiError

FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
CACHE_SIZE = 32


def _choice(body: dict, legacy: bool):
    name = "function_call" if legacy else "tool_choice"
    value = body.get(name)
    if value is None:
        return "auto", None, name
    if isinstance(value, str):
        if value not in ("auto", "none", "required") or (legacy and value == "required"):
            allowed = '"auto", "none"' + ("" if legacy else ', "required"')
            raise ApiError(f"'{name}' must be {allowed} or a function", param=name)
        return value, None, name
    fn = value if legacy else (value.get("function") if isinstance(value, dict) and value.get("type") == "function"
                               else None)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        shape = '{"name": ...}' if legacy else '{"type": "function", "function": {"name": ...}}'
        raise ApiError(f"'{name}' must be a string or {shape}", param=name)
    return "function", fn["name"], name


def tool_request(body: dict, chat: bool, service) -> ToolRequest | None:
    """The request's tools, or None when it has none (and no earlier calls in its messages); checked before the
    prompt is rendered (the schemas' limits, whether the program can constrain what the choice asks). The last
    CACHE_SIZE distinct tool fields are kept checked (with their grammar, ToolRequest.constraint): every turn of
    a tool conversation sends the same tools, and checking 20 schemas costs milliseconds."""
    if not chat or not any(body.get(f) is not None for f in FIELDS):
        return _tool_request(body, chat, service)
    try:
        key = json.dumps([body.get(f) for f in FIELDS] + [has_tool_messages(body.get("messages")),
                                                          tool_format(service.meta, service.tokenizer)])
    except (TypeError, ValueError, RecursionError):  # not cached (the checks name what is wrong)
        return _tool_request(body, chat, service)
    cache = service.tool_requests
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    request = _tool_request(body, chat, service)
    cache[key] = request
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return request


def _tool_request(body: dict, chat: bool, service) -> ToolRequest | None:
    given = [f for f in FIELDS if body.get(f) is not None]
    if not chat:
        if given:
            raise ApiError(f"'{given[0]}' needs /v1/chat/completions", param=given[0])
        return None
    if body.get("tools") is not None and body.get("functions") is not None:
        raise ApiError("give 'tools' or the legacy 'functions', not both", param="functions")
    legacy = body.get("functions") is not None or (body.get("tools") is None and body.get("function_call") is not None)
    if body.get("tool_choice") is not None and body.get("function_call") is not None:
        raise ApiError("give 'tool_choice' or the legacy 'function_call', not both", param="function_call")
    field = "functions" if legacy else "tools"
    try:
        tools = parse_tools(body[field], field, legacy=legacy) if body.get(field) is not None else []
    except ToolError as exc:
        raise ApiError(str(exc), param=field) from None
    choice, function, choice_field = _choice(body, legacy)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not tools and not has_tool_messages(body.get("messages")):
        if body.get(choice_field) not in (None, "none"):
            raise ApiError(f"'{choice_field}' needs '{field}'", param=choice_field)
        return None
    try:
        request = ToolRequest(tools, choice, function, parallel and not legacy,
                              tool_format(service.meta, service.tokenizer))
    except ToolError as exc:
        raise ApiError(str(exc), param=choice_field) from None
    try:
        request.check_limits(service.grammar.limits if service.grammar is not None else GrammarLimits())
    except ConstraintError as exc:
        raise ApiError(f"the tools cannot be used: {exc}", param=field) from None
    why = can_constrain(service.meta)
    if why is not None and request.must_call:
        raise ApiError(f"tool_choice {request.choice!r} needs constrained decoding, and {why}", param=choice_field)
    return request


def can_constrain(meta) -> str | None:
    """None when the program can constrain tool calls, else why not."""
    if not meta.config.allowed_mask:
        return EXPORT_HINT
    return PIPELINED_HINT if meta.pipelined else None


async def tool_rows(service, tools: ToolRequest | None, count: int, has_constraint: bool) -> list[dict] | None:
    """The EngineRequest fields of each row for a tool request that constrains (None: this request does not),
    compiled off the event loop like structured output; a refused grammar is a 400 naming 'tools'."""
    if tools is None or not tools.parses:
        return None
    if has_constraint:
        raise ApiError("tool calling and 'response_format' / 'structured_outputs' cannot be combined", param="tools")
    if can_constrain(service.meta) is not None:  # "auto" (tool_request refused the rest): parsed as written
        return None
    try:
        constraint = await service.off_loop(tools.constraint, service.tokenizer)  # limits: checked by tool_request
        if service.grammar is None:
            return [{"constraint": constraint} for _ in range(count)]
        matchers = await service.grammar.matchers(constraint, count)
    except ConstraintError as exc:
        raise ApiError(f"the tools cannot be used: {exc}", param="tools") from None
    return [{"constraint": constraint, "matcher": m} for m in matchers]
