"""Tool calls in each model family's own syntax: which syntax a chat template uses, the grammar that makes a
call parse and match its function's parameters schema, and the parser that reads calls back out of the text.

| format | a call as the model writes it | models |
| --- | --- | --- |
| `hermes` | `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one block per call | Qwen2.5, Qwen3, Hermes |
| `llama3_json` | `{"name": N, "parameters": {...}}` (optionally after `<|python_tag|>`), calls joined by `; ` | Llama 3.1+ |
| `mistral` | `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]` | Mistral (pre-v11 tokenizers) |
| `generic` | as `hermes`, taught by a system prompt (tool_prompt.py) | templates without tool support |

The grammars are llguidance Lark with one `%json` call schema (an `anyOf` over the functions, the name a `const`
first, so the name is chosen before the arguments). A marker that is one added token of the tokenizer (Qwen's
`<tool_call>`, Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`) is named by its id (`<[id]>`): llguidance
treats added tokens as special, outside any text regex. "auto" is a lazy grammar: free text, and once the
call's start marker is written (or, for `llama3_json`, once the answer starts with `{`), the rest is the call
grammar (llguidance's lazy lexemes, docs/syntax.md "Tool calling").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3_json", "mistral", "generic")
MODES = ("auto", "required")  # "none" and a named function: see ToolChoice
_TEXT = "/(?s:.*)/"


class ToolError(ValueError):
    """A tool definition, choice or message that cannot be used (one line, naming it)."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call (OpenAI's {"type": "function", "function": {...}})."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: a JSON string."""
        return json.dumps(self.arguments, ensure_ascii=False)


def detect_format(chat_template: str | None) -> str:
    """The call syntax a chat template teaches (by the markers it writes); `generic` for one without tools."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("tools" in text and "<|start_header_id|>" in text):
        return "llama3_json"
    return "generic"


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r} (choose from {', '.join(FORMATS)})")
    return name


def added_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens (text -> id): transformers' get_added_vocab, or a plain `tokenizers` one's."""
    if hasattr(tokenizer, "get_added_vocab"):
        return dict(tokenizer.get_added_vocab())
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "get_added_tokens_decoder"):
        return {t.content: i for i, t in inner.get_added_tokens_decoder().items()}
    return {}


@dataclass(frozen=True)
class Syntax:
    """One family's call syntax: `open` starts the calls (None: the answer's first `{`), `lead`/`trail` go
    around each call body, `sep` between calls; `array`: all calls are one JSON array (Mistral)."""

    open: str | None
    lead: str
    trail: str
    sep: str
    args_key: str = "arguments"
    array: bool = False
    tag: str | None = None  # an optional prefix token before the calls (Llama's <|python_tag|>)


SYNTAX = {
    "hermes": Syntax("<tool_call>", "\n", "\n</tool_call>", "\n"),
    "generic": Syntax("<tool_call>", "\n", "\n</tool_call>", "\n"),
    "llama3_json": Syntax(None, "", "", "; ", args_key="parameters", tag="<|python_tag|>"),
    "mistral": Syntax("[TOOL_CALLS]", "", "", "", array=True),
}


def _lark_text(text: str, tokens: dict[str, int]) -> str:
    """Lark items matching `text`: each added token in it by its id (llguidance treats added tokens as special:
    no string matches them), the rest as strings; "" for no text."""
    marks = sorted((t for t in tokens if t and t in text), key=len, reverse=True)
    if not marks:
        return json.dumps(text) if text else ""
    pattern = re.compile("|".join(re.escape(t) for t in marks))
    items, at = [], 0
    for hit in pattern.finditer(text):
        if hit.start() > at:
            items.append(json.dumps(text[at:hit.start()]))
        items.append(f"<[{tokens[hit.group()]}]>")
        at = hit.end()
    if at < len(text):
        items.append(json.dumps(text[at:]))
    return " ".join(items)


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` with its $defs / definitions moved into `defs` under `prefix` and its refs rewritten, so that it
    can sit inside the call schema (a "#/$defs/X" ref points at the document's root). Depth is bounded by the
    structured-output precheck (grammar_limits.py) before this runs."""
    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions") and isinstance(value, dict) and node is schema:
                for name, sub in value.items():
                    defs[f"{prefix}{'' if key == '$defs' else 'd_'}{name}"] = walk(sub)
                continue
            if key == "$ref" and isinstance(value, str):
                for head, tag in (("#/$defs/", ""), ("#/definitions/", "d_")):
                    if value.startswith(head):
                        value = f"#/$defs/{prefix}{tag}{value[len(head):]}"
                        break
                else:
                    if value.startswith("#"):
                        raise ToolError(f"$ref {value!r}: only refs into the parameters' own $defs are supported")
            out[key] = walk(value)
        return out

    return walk(schema)


def call_schema(tools: list[Tool], syntax: Syntax, parallel: bool) -> dict:
    """The JSON schema of the call body: one function's call, any of `tools` (name first), or Mistral's array."""
    from backends.mlx.llm.decoder.constraints import JSON_DEFAULTS  # (llguidance's settings; a light import here)

    defs: dict = {}
    variants = [{"type": "object",
                 "properties": {"name": {"const": t.name},
                                syntax.args_key: _hoisted(t.parameters, f"t{i}_", defs)},
                 "required": ["name", syntax.args_key], "additionalProperties": False}
                for i, t in enumerate(tools)]
    one = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if syntax.array:
        one = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    # a strict function makes the whole schema strict: a keyword llguidance cannot enforce is an error, not ignored
    lenient = not any(t.strict for t in tools)
    out = {"x-guidance": {**JSON_DEFAULTS, "lenient": lenient}, **one}
    if defs:
        out["$defs"] = defs
    return out


def call_grammar(tools: list[Tool], fmt: str, mode: str, parallel: bool, tokens: dict[str, int]) -> str:
    """The Lark grammar of an answer: `required` (calls only) or `auto` (text, or text then calls)."""
    syntax = SYNTAX[fmt]
    body = f"%json {json.dumps(call_schema(tools, syntax, parallel))}"
    more = "" if syntax.array or not parallel else f" ({_lark_text(syntax.sep, tokens)} call)*"
    lines = [f"body: {body}", f"TEXT: {_TEXT}"]
    if syntax.open is None:  # llama3_json: the answer is the call(s), optionally after the tag token
        lines.append("call: body")
        calls = f"call{more}"
        tag = f" | {_lark_text(syntax.tag, tokens)} {calls}" if syntax.tag in tokens else ""
        if mode == "required":
            return "\n".join([f"start: {calls}"] + lines)
        return "\n".join([f"start: NOBRACE | {calls}{tag}", "NOBRACE: /([^{](?s:.*))?/"] + lines)
    rest = " ".join(x for x in (_lark_text(syntax.lead, tokens), "body", _lark_text(syntax.trail, tokens)) if x)
    lines.append(f"call: {_lark_text(syntax.open, tokens)} {rest}")
    if mode == "required":
        return "\n".join([f"start: call{more}"] + lines)
    if syntax.open in tokens:  # the marker is a token no text matches: text, then optionally the calls
        return "\n".join([f"start: TEXT | TEXT call{more}"] + lines)
    # a text marker: a lazy lexeme ends the text at the first marker, after which the call grammar holds
    return "\n".join([f"start: TEXT | head {rest}{more}",
                      f"head[lazy]: /(?s:.*){re.escape(syntax.open)}/"] + lines)


def _call(obj, syntax: Syntax, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get(syntax.args_key, obj.get("arguments", obj.get("parameters")))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _json_values(text: str) -> list | None:
    """JSON values separated by `;` and/or whitespace (Llama's parallel calls); None if any part is not JSON."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def call_start(fmt: str, text: str) -> int | None:
    """Where the calls start in `text` (the marker's index), or None when there is none (yet)."""
    syntax = SYNTAX[fmt]
    if syntax.open is not None:
        index = text.find(syntax.open)
        return None if index < 0 else index
    stripped = text.lstrip()
    if stripped.startswith(syntax.tag):
        return len(text) - len(stripped)
    return len(text) - len(stripped) if stripped.startswith("{") else None


def may_start(fmt: str, text: str) -> int:
    """How many trailing characters of `text` could still grow into the call marker (held back when streaming)."""
    syntax = SYNTAX[fmt]
    if syntax.open is None:
        return len(text) if not text.strip() or syntax.tag.startswith(text.lstrip()) else 0
    for n in range(min(len(syntax.open) - 1, len(text)), 0, -1):
        if syntax.open.startswith(text[-n:]):
            return n
    return 0


def parse_calls(fmt: str, text: str, names: set[str], final: bool = True) -> tuple[list[ToolCall], int] | None:
    """The calls in `text` (which starts at the marker, call_start): (calls, characters consumed), or None when
    the text is not calls to known functions. final=False: the complete leading calls so far (hermes blocks)."""
    syntax = SYNTAX[fmt]
    if fmt in ("hermes", "generic"):
        calls, i = [], 0
        while True:
            j = len(text) - len(text[i:].lstrip())
            if j == len(text) or not text.startswith(syntax.open, j):
                break
            end = text.find("</tool_call>", j)
            if end < 0:
                if not final:
                    break
                end_body = len(text)  # the model stopped before the closing marker
            else:
                end_body = end
            call = _call(_one_json(text[j + len(syntax.open):end_body]), syntax, names)
            if call is None:
                return None
            calls.append(call)
            i = len(text) if end < 0 else end + len("</tool_call>")
        if final and (not calls or text[i:].strip()):
            return None
        return calls, i
    if not final:
        return [], 0
    body = text
    if syntax.open is not None:
        body = text[text.find(syntax.open) + len(syntax.open):]
    elif body.lstrip().startswith(syntax.tag):
        body = body.lstrip()[len(syntax.tag):]
    values = _json_values(body)
    if not values:
        return None
    if syntax.array:
        if len(values) != 1 or not isinstance(values[0], list):
            values = None if len(values) != 1 or not isinstance(values[0], dict) else values
        else:
            values = values[0]
    if not values:
        return None
    calls = [_call(v, syntax, names) for v in values]
    return None if any(c is None for c in calls) else (calls, len(text))


def _one_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def render_calls(fmt: str, calls: list[dict]) -> str:
    """An earlier assistant turn's calls ({"name", "arguments": dict}) as the model writes them (generic format)."""
    syntax = SYNTAX[fmt]
    bodies = [json.dumps({"name": c["name"], syntax.args_key: c["arguments"]}, ensure_ascii=False) for c in calls]
    return syntax.sep.join(f"{syntax.open}{syntax.lead}{b}{syntax.trail}" for b in bodies)
