"""Tool calling through the OpenAI endpoint, with the official client: each family's format on one tiny random
program (allowed-token mask input), every tool_choice mode, seeded required calls validated against their
schemas, streaming against the whole answer, a conversation with results, parallel calls, bad requests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import urllib.error
import urllib.request

from backends.mlx.llm.decoder.tool_formats import FORMATS
from backends.mlx.llm.decoder.tool_output import ToolOutput
from backends.mlx.serve.app import ServerThread
from serve_helpers import lmtp_exchange, tiny_pte
from tool_helpers import ADD, TOOLS, tool_pte, use_format

pytestmark = [pytest.mark.server, pytest.mark.slow]  # an export and hundreds of constrained requests

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerThread(tool_pte(tmp_path_factory), model_name="tools").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, **kw):
    kw = {"model": "tools", "messages": ASK, "tools": TOOLS, "max_tokens": 300, "seed": 1, "temperature": 1.0, **kw}
    return client.chat.completions.create(**kw)


def _valid(call) -> bool:
    """The call names a tool and its arguments parse and match that tool's schema."""
    if call.function.name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_the_exported_format_is_detected_from_the_template(server):
    assert server.service.meta.tool_call_format == "hermes"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tool_choice_mode(server, client, fmt):
    use_format(server.service, fmt)
    required = _ask(client, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    assert all(_valid(c) and c.type == "function" for c in required.message.tool_calls)
    ids = [c.id for c in required.message.tool_calls]
    assert len(set(ids)) == len(ids) and all((len(i) == 9 and i.isalnum()) if fmt == "mistral" else
                                             i.startswith("call_") for i in ids)  # Mistral's templates want 9
    named = _ask(client, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert named.finish_reason == "tool_calls"
    assert {c.function.name for c in named.message.tool_calls} == {"add"} and all(map(_valid, named.message.tool_calls))
    none = _ask(client, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")
    # auto: text, or calls that are valid (the rest of a call is constrained once its marker is sampled)
    for seed in range(6):
        auto = _ask(client, seed=seed).choices[0]
        calls = auto.message.tool_calls or []
        assert all(map(_valid, calls))
        assert (auto.finish_reason == "tool_calls") == bool(calls) or auto.finish_reason == "length"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fifty_seeded_required_calls_all_validate(server, client, fmt):
    """Constrained: every call parses and validates (one call each, so that none is cut by max_tokens). The
    control, the same requests unconstrained ("none", the answers read as calls afterwards), must not: this
    random model never writes a call by itself."""
    use_format(server.service, fmt)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda s: _ask(client, tool_choice="required", seed=s, parallel_tool_calls=False),
                                range(50)))
        free = list(pool.map(lambda s: _ask(client, tool_choice="none", seed=s, max_tokens=60), range(50)))
    assert all(a.choices[0].finish_reason == "tool_calls" for a in answers)
    calls = [c for a in answers for c in a.choices[0].message.tool_calls]
    assert len(calls) == 50 and all(map(_valid, calls))
    assert len({(c.function.name, c.function.arguments) for c in calls}) > 10  # seeded draws, not one answer
    parsed = [ToolOutput(fmt, set(SCHEMAS)).split(a.choices[0].message.content or "")[1] for a in free]
    assert sum(bool(p) for p in parsed) < 50


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_deltas_reassemble_to_the_answer(server, client, fmt):
    use_format(server.service, fmt)
    for choice, seed in (("required", 3), ("auto", 4), ("auto", 2)):
        whole = _ask(client, tool_choice=choice, seed=seed).choices[0]
        content, calls, finish, first = "", {}, None, {}
        for chunk in _ask(client, tool_choice=choice, seed=seed, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    if d.id is not None:  # a call's first delta: index, id, name; then its arguments
                        first[d.index] = (d.id, d.function.name, d.function.arguments)
                        calls[d.index] = ""
                    else:
                        calls[d.index] += d.function.arguments
                finish = c.finish_reason or finish
        assert finish == whole.finish_reason
        assert content == (whole.message.content or "")
        got = [(first[i][1], first[i][2] + calls[i]) for i in sorted(calls)]
        assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert all(first[i][2] == "" for i in first)


def test_a_tool_loop_with_the_official_client(server, client):
    """Call, run the function, send the result back, as an OpenAI client does; each turn is valid."""
    use_format(server.service, "hermes")
    messages = list(ASK)
    for turn in range(2):
        answer = _ask(client, messages=messages, tool_choice="required", seed=10 + turn).choices[0]
        assert answer.message.tool_calls and all(map(_valid, answer.message.tool_calls))
        messages.append(answer.message.model_dump(exclude_none=True))
        for call in answer.message.tool_calls:
            args = json.loads(call.function.arguments)
            result = args["a"] + args["b"] if call.function.name == "add" else f"sunny in {args['city']}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    final = _ask(client, messages=messages, tool_choice="none", max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    first = _ask(client, tool_choice="none", max_tokens=8)
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the calls and results are in the prompt


def test_parallel_calls(server, client):
    use_format(server.service, "hermes")
    counts = [len(_ask(client, tool_choice="required", seed=s, max_tokens=400).choices[0].message.tool_calls)
              for s in range(8)]
    assert max(counts) > 1  # several calls in one answer happen
    single = [_ask(client, tool_choice="required", seed=s, parallel_tool_calls=False).choices[0] for s in range(8)]
    assert all(len(a.message.tool_calls) == 1 and _valid(a.message.tool_calls[0]) for a in single)


def test_legacy_functions_take_the_same_path(server, client):
    use_format(server.service, "hermes")
    body = {"model": "tools", "messages": ASK, "functions": [t["function"] for t in TOOLS], "seed": 2,
            "function_call": {"name": "get_weather"}, "max_tokens": 300}
    status, r = _post(server.url + "/v1/chat/completions", body)
    calls = r["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS["get_weather"])


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _healthy(server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
        return response.status == 200


def _deep_schema(depth):
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("change, param, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep_schema(100)}}]}, "tools", "nest"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "dependentSchemas": {"a": {}}}}}], "tool_choice": "required"}, "tools", "dependentSchemas"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "c1", "content": "4"}]}, "messages", "answers no earlier"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"functions": [ADD["function"]]}, "functions", "not both"),
    ({"response_format": {"type": "json_object"}}, "tools", "cannot be combined"),
])
def test_bad_tool_requests_are_400s_and_the_server_stays_healthy(server, change, param, needle):
    use_format(server.service, "hermes")
    body = {"model": "tools", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    status, r = _post(server.url + "/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    error = r["error"]
    assert status == 400 and error["param"] == param and needle in error["message"]
    assert "\n" not in error["message"]
    assert _healthy(server)
    status, ok = _post(server.url + "/v1/chat/completions", {"model": "tools", "messages": ASK, "tools": TOOLS,
                                                             "tool_choice": "required", "max_tokens": 300,
                                                             "parallel_tool_calls": False})
    assert status == 200 and ok["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_on_completions_are_refused(server):
    status, r = _post(server.url + "/v1/completions", {"prompt": "hi", "tools": TOOLS})
    assert status == 400 and r["error"]["param"] == "tools"


def test_a_program_without_the_mask_refuses_required(tmp_path_factory):
    srv = ServerThread(tiny_pte(tmp_path_factory), model_name="plain").start()
    try:
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            status, r = _post(srv.url + "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": choice})
            assert status == 400 and r["error"]["param"] == "tool_choice"
            assert "allowed-token mask" in r["error"]["message"]
    finally:
        srv.stop()


def test_lmtp_generate_takes_tools(server):
    """LMTP: the client renders the prompt and parses; the server constrains the tokens to the call syntax."""
    import asyncio

    from backends.mlx.llm.decoder.tool_calls import parse_tools
    from backends.mlx.llm.decoder.tool_prompt import tool_chat_text

    use_format(server.service, "hermes")
    tok = server.service.tokenizer
    prompt = tool_chat_text(tok, ASK, parse_tools(TOOLS), "hermes")
    frames = ['MODEL_INFO {"stream_id": 0}']
    frames += [f'GENERATE {json.dumps({"stream_id": s, "prompt": prompt, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 300, "seed": s, "temperature": 1.0})}'
               for s in (1, 2, 3)]
    frames.append(f'GENERATE {json.dumps({"stream_id": 9, "prompt": prompt, "tools": TOOLS, "tool_choice": "maybe"})}')
    done = lambda ms: sum(e.get("finish_reason") is not None for k, p in ms if k == "TOKEN" for e in p) >= 4
    messages = asyncio.run(lmtp_exchange(server, frames, done, timeout=120))
    info = next(p for k, p in messages if k == "MSG")
    assert info["model_info"]["tool_call_format"] == "hermes"
    entries = [e for k, p in messages if k == "TOKEN" for e in p]
    assert any(e["stream_id"] == 9 and "tool_choice" in e.get("error", "") for e in entries)
    for s in (1, 2, 3):
        ids = [e["token"] for e in entries if e["stream_id"] == s and e["token"] is not None]
        assert [e["finish_reason"] for e in entries if e["stream_id"] == s][-1] == "stop"
        text = tok.decode([t for t in ids if t not in server.service.meta.eos_token_ids], skip_special_tokens=False)
        content, calls = ToolOutput("hermes", set(SCHEMAS)).split(text)
        assert content == "" and len(calls) == 1
        jsonschema.validate(calls[0].call.arguments, SCHEMAS[calls[0].call.name])


def test_repeated_tools_compile_once(server, client, monkeypatch):
    """Each turn of a tool conversation sends the same tools: the grammar is compiled once, then copied."""
    use_format(server.service, "hermes")
    _ask(client, tool_choice="required", max_tokens=1)  # the vocabulary exists
    vocabulary = server.service.grammar._vocabulary
    compiles = []
    real = vocabulary.matchers
    monkeypatch.setattr(vocabulary, "matchers", lambda c, n=1: compiles.append(c) or real(c, n))
    tools = [{"type": "function", "function": {**ADD["function"], "name": "add_once"}}]
    answers = [_ask(client, tools=tools, tool_choice="required", parallel_tool_calls=False, seed=s).choices[0]
               for s in range(3)]
    assert len(compiles) == 1
    assert all(a.message.tool_calls[0].function.name == "add_once" for a in answers)
