"""Tool calls without a program: format detection, each family's grammar against llguidance (what it accepts
and refuses), parsing calls back out of text, the streamed split against the whole one, tool definitions and
conversations with calls and results."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from backends.mlx.llm.builtin.tiny_model import train_tokenizer
from backends.mlx.llm.decoder.grammar_limits import ConstraintError, GrammarLimits
from backends.mlx.llm.decoder.tool_calls import MAX_TOOLS, ToolRequest, parse_tools
from backends.mlx.llm.decoder.tool_formats import (FORMATS, SYNTAX, ToolError, added_tokens, call_grammar,
                                                   detect_format, render_calls)
from backends.mlx.llm.decoder.tool_output import ToolOutput
from backends.mlx.llm.decoder.tool_prompt import check_tool_messages, tool_chat_text
from tool_helpers import TEMPLATES, TOOLS, tool_tokenizer

CALL = {"name": "add", "arguments": {"a": 3, "b": -4}}
BAD_ARGS = {"name": "add", "arguments": {"a": 3}}  # "b" is required
UNKNOWN = {"name": "nope", "arguments": {}}


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


@pytest.fixture(scope="module")
def lltok(tok):
    return LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=len(tok), eos_token=[tok.eos_token_id])


def _written(fmt: str, calls: list[dict], text: str = "") -> str:
    """`calls` as the family writes them, after `text`."""
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if fmt == "mistral":
        return text + "[TOOL_CALLS]" + json.dumps(calls)
    return text + render_calls(fmt, calls)


def _accepts(lltok, tok, grammar: str, text: str) -> bool:
    matcher = LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


def test_the_format_is_detected_from_the_template():
    assert {fmt: detect_format(t) for fmt, t in TEMPLATES.items()} == {f: f for f in FORMATS}
    assert detect_format(None) == "generic"


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_grammar_accepts_calls_and_refuses_the_rest(fmt, tok, lltok):
    tools = parse_tools(TOOLS)
    tokens = added_tokens(tok)
    required = call_grammar(tools, fmt, "required", True, tokens)
    assert _accepts(lltok, tok, required, _written(fmt, [CALL]))
    assert _accepts(lltok, tok, required, _written(fmt, [CALL, CALL]))
    for bad in ("just text", _written(fmt, [BAD_ARGS]), _written(fmt, [UNKNOWN])):
        assert not _accepts(lltok, tok, required, bad), bad
    single = call_grammar(tools, fmt, "required", False, tokens)
    assert _accepts(lltok, tok, single, _written(fmt, [CALL]))
    assert not _accepts(lltok, tok, single, _written(fmt, [CALL, CALL]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_grammar_allows_text_and_constrains_a_started_call(fmt, tok, lltok):
    auto = call_grammar(parse_tools(TOOLS), fmt, "auto", True, added_tokens(tok))
    assert _accepts(lltok, tok, auto, "Hello there, no call needed.")
    lead = "" if fmt == "llama3_json" else "Let me see. "
    assert _accepts(lltok, tok, auto, _written(fmt, [CALL], lead))
    assert not _accepts(lltok, tok, auto, _written(fmt, [BAD_ARGS], lead))
    assert not _accepts(lltok, tok, auto, _written(fmt, [UNKNOWN], lead))


def test_a_text_marker_is_lazy():
    """Without the marker as a token (a tokenizer that lacks it), the text ends at the marker's text."""
    tok = train_tokenizer()
    lltok = LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=len(tok), eos_token=[tok.eos_token_id])
    auto = call_grammar(parse_tools(TOOLS), "hermes", "auto", True, added_tokens(tok))
    assert "[lazy]" in auto
    assert _accepts(lltok, tok, auto, "I will call. " + render_calls("hermes", [CALL]))
    assert not _accepts(lltok, tok, auto, "I will call. <tool_call>\nnot json\n</tool_call>")


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_parse_back_and_stream_to_the_same_split(fmt):
    names = {"add", "get_weather"}
    calls = [CALL, {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]
    lead = "" if fmt == "llama3_json" else "Checking. "
    text = _written(fmt, calls, lead)
    content, issued = ToolOutput(fmt, names).split(text)
    assert content == lead and [(c.call.name, c.call.arguments) for c in issued] == [
        (c["name"], c["arguments"]) for c in calls]
    for step in (1, 3, 7):  # any cut into pieces gives the same content and calls
        out, streamed, got = ToolOutput(fmt, names), "", []
        for i in range(0, len(text), step):
            piece, new = out.feed(text[i:i + step])
            streamed += piece
            got += new
        piece, new = out.finish()
        assert (streamed + piece, [c.call for c in got + new]) == (content, [c.call for c in issued])
    # not calls after all: all of it is content
    for bad in (_written(fmt, [UNKNOWN], lead), _written(fmt, [CALL], lead)[:-3], "plain text"):
        content, issued = ToolOutput(fmt, names).split(bad)
        assert issued == [] and content == bad


@pytest.mark.parametrize("raw, needle", [
    ("x", "must be a list"),
    ([{"type": "function"}], "must be {"),
    ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "at most 128"),
])
def test_bad_tool_definitions_are_named(raw, needle):
    with pytest.raises(ToolError, match=needle.replace("{", r"\{")):
        parse_tools(raw)


def test_a_choice_must_name_a_known_function():
    tools = parse_tools(TOOLS)
    with pytest.raises(ToolError, match="'nope'"):
        ToolRequest(tools, "function", "nope")
    with pytest.raises(ToolError, match="needs tools"):
        ToolRequest([], "required")


def test_schema_limits_and_strictness(tok, lltok):
    deep = {"type": "object"}
    for _ in range(80):
        deep = {"type": "object", "properties": {"x": deep}}
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": deep}}])
    with pytest.raises(ConstraintError, match="function 'f' parameters: .*nested"):
        ToolRequest(tools, "required").check_limits(GrammarLimits())
    # a keyword llguidance does not enforce: an error for a strict function, ignored for the others
    for strict in (True, False):
        tools = parse_tools([{"type": "function", "function": {"name": "f", "strict": strict, "parameters": {
            "type": "object", "properties": {"s": {"type": "string"}}, "dependentSchemas": {"s": {}}}}}])
        matcher = LLMatcher(lltok, ToolRequest(tools, "required").constraint(tok).spec, log_level=0)
        assert matcher.is_error() == strict
        if strict:
            assert "dependentSchemas" in matcher.get_error()


def test_defs_move_into_the_call_schema(tok, lltok):
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
              "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    grammar = call_grammar(tools, "hermes", "required", True, added_tokens(tok))
    ok = render_calls("hermes", [{"name": "f", "arguments": {"p": {"x": 1}}}])
    bad = render_calls("hermes", [{"name": "f", "arguments": {"p": {"y": 1}}}])
    assert _accepts(lltok, tok, grammar, ok) and not _accepts(lltok, tok, grammar, bad)


def test_messages_with_calls_and_results():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    clean = check_tool_messages(messages)
    assert clean[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 2}
    assert clean[2] == {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "4"}
    with pytest.raises(ValueError, match=r"messages\[2\].*'c9' answers no earlier tool call"):
        check_tool_messages(messages[:2] + [{"role": "tool", "tool_call_id": "c9", "content": "4"}])
    with pytest.raises(ValueError, match="answers no earlier"):  # answered twice
        check_tool_messages(messages + [{"role": "tool", "tool_call_id": "c1", "content": "4"}])


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompts_carry_the_tools_and_the_history(fmt, tok):
    tok.chat_template = TEMPLATES[fmt]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    text = tool_chat_text(tok, messages, parse_tools(TOOLS), fmt)
    assert "get_weather" in text and "maxLength" in text  # the tools, with their schemas
    args = {"llama3_json": '"parameters": {"a": 2, "b": 2}'}.get(fmt, '"arguments": {"a": 2, "b": 2}')
    assert args in text and "4" in text.split("add")[-1]
    if fmt == "generic":
        assert SYNTAX["generic"].open in text and "<tool_response>\n4\n</tool_response>" in text


def test_export_takes_a_tool_call_format():
    from backends.mlx.cli.main import build_parser
    from backends.mlx.llm.decoder.tool_formats import check_format

    args = build_parser().parse_args(["export", "--model", "m", "--out", "o.pte", "--tool-call-format", "mistral"])
    assert args.tool_call_format == "mistral"
    assert build_parser().parse_args(["export", "--model", "m", "--out", "o.pte"]).tool_call_format is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--model", "m", "--out", "o.pte", "--tool-call-format", "nope"])
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'"):
        check_format("nope")
