"""Tool calling in the Python API (etmlx.generate(..., tools=...)) and `etmlx chat --tools`, on the tiny tool
program (hermes format, mask input)."""

from __future__ import annotations

import io
import json
import sys

import jsonschema
import pytest

import etmlx
from helpers import run_cli
from tool_helpers import TOOLS, tool_pte

pytestmark = pytest.mark.slow  # the tool program's export (shared with test_serve_tools.py)

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return etmlx.load(tool_pte(tmp_path_factory))


def test_generate_returns_parsed_calls_that_match_their_schemas(model):
    for seed in range(5):
        reply = etmlx.generate(model, ASK, 300, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                               seed=seed, temperature=1.0)
        assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1 and reply.content == ""
        call = reply.tool_calls[0]
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    named = etmlx.generate(model, ASK, 300, tools=TOOLS, tool_choice="add", seed=3, temperature=1.0)
    assert {c.name for c in named.tool_calls} == {"add"}
    none = etmlx.generate(model, ASK, 20, tools=TOOLS, tool_choice="none", seed=3, temperature=1.0)
    assert none.tool_calls == [] and none.finish_reason in ("stop", "length")


def test_a_conversation_with_results(model):
    messages = list(ASK)
    reply = etmlx.generate(model, messages, 300, tools=TOOLS, tool_choice="add", parallel_tool_calls=False, seed=1,
                           temperature=1.0)
    messages.append(reply.message())
    call = reply.tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": reply.ids[0],
                     "content": str(call.arguments["a"] + call.arguments["b"])})
    after = etmlx.generate(model, messages, 300, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           seed=2, temperature=1.0)
    assert len(after.tool_calls) == 1
    with pytest.raises(ValueError, match="answers no earlier tool call"):
        etmlx.generate(model, ASK + [{"role": "tool", "tool_call_id": "x", "content": "1"}], 5, tools=TOOLS)
    with pytest.raises(ValueError, match="'nope'"):
        etmlx.generate(model, ASK, 5, tools=TOOLS, tool_choice="nope")


def test_chat_runs_the_calls_with_tool_exec(model, tmp_path, monkeypatch):
    pte = model.pte
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    script = tmp_path / "run_tool.py"
    script.write_text("import json, sys\ncall = json.load(sys.stdin)\nprint('ran ' + call['name'])\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the weather?\n"))
    ran = run_cli("chat", pte, "-m", "200", "--seed", "1", "--temperature", "1.0", "--tools", tools, "--tool-choice", "add",
                  "--tool-exec", f"{sys.executable} {script}")
    assert ran.returncode == 0, ran.stderr[-2000:]
    calls = [line for line in ran.stderr.splitlines() if line.startswith("[tool call: add(")]
    assert calls and all(json.loads(line[len("[tool call: add("):-2]).keys() == {"a", "b"} for line in calls)
    assert "[result: ran add]" in ran.stderr


def test_inspect_shows_the_tool_call_format(model):
    ran = run_cli("inspect", model.pte)
    assert ran.returncode == 0 and "tool-call format hermes" in ran.stdout
