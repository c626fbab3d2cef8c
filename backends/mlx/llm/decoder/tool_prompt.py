"""A conversation with tools to prompt text: the checkpoint's chat template renders the tools (its `tools`
variable) and the earlier calls and results (assistant `tool_calls`, `tool` messages), as transformers passes
them; a template without tool support (format `generic`) gets the tools described in a system message and the
calls and results written out as text.

Messages as OpenAI sends them: an assistant message may carry `tool_calls` ([{"id", "type": "function",
"function": {"name", "arguments": JSON text}}]) and no content; a `tool` message answers one of them by
`tool_call_id`. Legacy: an assistant `function_call` ({"name", "arguments"}) and a `function` message
(by `name`). A result that answers no earlier call is an error.
"""

from __future__ import annotations

import json

from backends.mlx.llm.decoder import prompt as prompt_rules
from backends.mlx.llm.decoder.tool_formats import SYNTAX, Tool, render_calls

GENERIC_SYSTEM = ("You can call functions. To call one, answer with\n{example}\n(one block per call) and nothing "
                  "else; the results come back in the next message. The functions, as JSON:\n{tools}")


def _content(message: dict, i: int, may_be_empty: bool) -> str:
    content = message.get("content")
    if content is None and may_be_empty:
        return ""
    try:
        return prompt_rules.check_messages([{"role": message["role"], "content": content}])[0]["content"]
    except ValueError as exc:
        raise ValueError(str(exc).replace("messages[0]", f"messages[{i}]")) from None


def check_tool_messages(messages) -> list[dict]:
    """Messages in transformers' tool form (arguments as objects, each result naming its call); ValueError
    (naming messages[i]) for a malformed call or a result that answers no earlier call."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    out, pending, counter = [], {}, 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be {prompt_rules.ROLES_HINT}")
        role = message["role"]
        calls = message.get("tool_calls")
        if role == "assistant" and message.get("function_call") is not None and calls is None:
            counter += 1
            calls = [{"id": f"legacy_{counter}", "type": "function", "function": message["function_call"]}]
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            clean = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                     "\"function\": {\"name\", \"arguments\"}}")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
                if not isinstance(args, dict):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
                call_id = call.get("id", f"call_{i}_{j}")
                if not isinstance(call_id, str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].id must be a string")
                pending[call_id] = fn["name"]
                clean.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
            out.append({"role": "assistant", "content": _content(message, i, True), "tool_calls": clean})
        elif role in ("tool", "function"):
            if role == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str) or call_id not in pending:
                    raise ValueError(f"messages[{i}] is a 'tool' message whose tool_call_id {call_id!r} answers no "
                                     "earlier tool call")
            else:  # legacy: the latest unanswered call of that name
                name = message.get("name")
                call_id = next((k for k, v in reversed(pending.items()) if v == name), None)
                if call_id is None:
                    raise ValueError(f"messages[{i}] is a 'function' message for {name!r}, which no earlier "
                                     "function_call called")
            out.append({"role": "tool", "tool_call_id": call_id, "name": pending.pop(call_id),
                        "content": _content(message, i, False)})
        else:
            out.append({"role": role, "content": _content(message, i, False)})
    return out


def _generic(messages: list[dict], tools: list[Tool], fmt: str) -> list[dict]:
    """The conversation for a template that knows no tools: a system message teaching the call syntax, calls and
    results as plain text."""
    plain = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            text = render_calls(fmt, calls)
            plain.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
        elif m["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            plain.append({"role": m["role"], "content": m["content"]})
    if tools:
        syntax = SYNTAX[fmt]
        example = f"{syntax.open}{syntax.lead}{{\"name\": <function name>, \"arguments\": <a JSON object>}}{syntax.trail}"
        system = GENERIC_SYSTEM.format(example=example, tools="\n".join(json.dumps(t.openai()["function"]) for t in tools))
        if plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{system}"}
        else:
            plain.insert(0, {"role": "system", "content": system})
    return plain


def tool_chat_text(tokenizer, messages, tools: list[Tool], fmt: str) -> str:
    """The prompt text of a conversation with `tools` (maybe none: a history with calls), in format `fmt`."""
    if not prompt_rules.has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template: give raw text instead")
    clean = check_tool_messages(messages)
    if fmt == "generic":
        return prompt_rules.chat_text(tokenizer, _generic(clean, tools, fmt))
    return tokenizer.apply_chat_template(clean, tools=[t.openai() for t in tools] or None,
                                         add_generation_prompt=True, tokenize=False)


def tool_chat_prompt(tokenizer, messages, tools: list[Tool], fmt: str) -> list[int]:
    return list(tokenizer.encode(tool_chat_text(tokenizer, messages, tools, fmt), add_special_tokens=False))


def has_tool_messages(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("function_call") or m.get("role") in ("tool", "function"))
        for m in messages)
