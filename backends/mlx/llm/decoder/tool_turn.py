"""One assistant turn with tools on a loaded program (the Python API's generate(tools=...), `etmlx chat --tools`):
the conversation rendered with the tools, the answer constrained as the tool choice says (where the program has
the allowed-token mask input), and the answer split into content and calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.mlx.llm.decoder.constraints import EXPORT_HINT
from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.llm.decoder.meta import PIPELINED_HINT
from backends.mlx.llm.decoder.text_generation import stream_text
from backends.mlx.llm.decoder.tool_calls import ToolRequest
from backends.mlx.llm.decoder.tool_formats import ToolCall
from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer
from backends.mlx.llm.decoder.tool_output import ToolOutput
from backends.mlx.llm.decoder.tool_prompt import tool_chat_prompt


@dataclass
class ToolReply:
    """The answer: `content` (text beside the calls, "" for none), `tool_calls` (parsed, each matching its
    function's schema when constrained), `ids` (one per call, for the results' tool_call_id), `finish_reason`
    ("tool_calls", "stop" or "length"), `text` (the answer as the model wrote it)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""

    def message(self) -> dict:
        """The assistant message to append to the conversation (OpenAI's shape)."""
        calls = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                 for i, c in zip(self.ids, self.tool_calls)]
        return {"role": "assistant", "content": self.content or None, **({"tool_calls": calls} if calls else {})}


def tool_constraint(decoder, tools: ToolRequest):
    """The answer's Constraint, or None ("none", or "auto" on a program that cannot constrain: parsed as written);
    ValueError for "required" / a named function on a program that cannot constrain."""
    meta = decoder.meta
    why = EXPORT_HINT if not meta.config.allowed_mask else PIPELINED_HINT if meta.pipelined else None
    if why is not None:
        if tools.must_call:
            raise ValueError(f"tool_choice {tools.choice!r} needs constrained decoding, and {why}")
        return None
    tools.check_limits(GrammarLimits())
    return tools.constraint(decoder.tokenizer)


def tool_turn(decoder, messages, tools: ToolRequest, max_tokens: int, params=None, stop=(), on_text=None,
              reuse: bool = False, speculation=None, adapter: str | None = None) -> tuple[ToolReply, list[int], list[int]]:
    """(reply, prompt ids, generated ids). `on_text(piece)`: each piece of content as it streams. `adapter`: a
    switchable LoRA adapter's name (Decoder.stream)."""
    tokenizer = decoder.tokenizer
    prompt = tool_chat_prompt(tokenizer, messages, tools.tools, tools.fmt)
    constraint = tool_constraint(decoder, tools)
    if constraint is not None:
        decoder.matcher(constraint)  # a refused grammar: one line, before anything is decoded
    max_tokens = max(1, min(max_tokens, decoder.meta.max_seq_len - len(prompt)))
    out = ToolOutput(tools.fmt, tools.callable_names()) if tools.parses else None
    detok = IncrementalDetokenizer(tokenizer, prompt, keep_special=out is not None)  # markers may be special
    eos = set(decoder.meta.eos_token_ids)
    ids, text, content, issued, last = [], "", "", [], None

    def take(piece: str, final: bool = False) -> None:
        nonlocal text, content
        text += piece
        shown, calls = out.feed(piece) if out is not None else (piece, [])
        if final and out is not None:
            more, last_calls = out.finish()
            shown, calls = shown + more, calls + last_calls
        content += shown
        issued.extend(calls)
        if shown and on_text is not None:
            on_text(shown)

    for last in stream_text(decoder, prompt, max_tokens, params, stop, tokenizer if stop else None, constraint, reuse=reuse,
                            speculation=speculation, adapter=adapter):
        ids.append(last.token)
        if last.token not in eos:
            take(detok.add(last.token))
    take(detok.flush(), final=True)
    finish = last.finish_reason if last is not None else "length"
    calls = [c.call for c in issued]
    if calls and finish == "stop":
        finish = "tool_calls"
    return ToolReply(content, calls, [c.id for c in issued], finish, text), prompt, ids
