"""A tool request's choices: each piece's text split into content and calls (llm/decoder/tool_output.py), and
the calls in OpenAI's shapes (`message.tool_calls`, streamed `delta.tool_calls`)."""

from __future__ import annotations

from backends.mlx.llm.decoder.tool_calls import ToolRequest
from backends.mlx.llm.decoder.tool_output import IssuedCall, ToolOutput


async def tool_pieces(pieces, tools: ToolRequest, count: int):
    """(index, piece) with the piece's text cut to content and its completed calls in piece.tool_calls; a choice
    that ends with calls ends with finish_reason "tool_calls"."""
    outputs = [ToolOutput(tools.fmt, tools.callable_names()) for _ in range(count)]
    called = [False] * count
    try:
        async for index, piece in pieces:
            out = outputs[index]
            piece.text, piece.tool_calls = out.feed(piece.text)
            if piece.finish_reason is not None:
                more, last = out.finish()
                piece.text += more
                piece.tool_calls += last
            called[index] = called[index] or bool(piece.tool_calls)
            if piece.finish_reason == "stop" and called[index]:
                piece.finish_reason = "tool_calls"
            yield index, piece
    finally:
        await pieces.aclose()


def message_calls(calls: list[IssuedCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.call.name, "arguments": c.call.arguments_json}}
            for c in calls]


def delta_calls(calls: list[IssuedCall]) -> list[list[dict]]:
    """Each call as OpenAI streams it: a delta with its index, id and name (arguments ""), then one with the
    arguments."""
    out = []
    for c in calls:
        out.append([{"index": c.index, "id": c.id, "type": "function",
                     "function": {"name": c.call.name, "arguments": ""}}])
        out.append([{"index": c.index, "function": {"arguments": c.call.arguments_json}}])
    return out
