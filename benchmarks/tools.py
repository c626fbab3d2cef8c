"""`etmlx bench tools`: tool calling through the server, on the tiny tool program (benchmarks/tool_model.py).

- validity: per format, `requests` seeded "required" calls (one call each) constrained by the grammar, and the
  same requests unconstrained (tool_choice "none", the text parsed afterwards as the format's calls): the share
  that parses and matches its function's schema (jsonschema). A random model never writes a call by itself, so
  the unconstrained rate is the floor; a real checkpoint's is whatever it is.
- time to first token: one chat request (max_tokens 1, tool_choice "auto": the lazy grammar) with 20 tools
  against the same request without tools, in alternating blocks, with the prompt cache on (each block's first
  request is a warm-up that fills the cache; the server keeps compiled grammars); medians and their ratio; and
  the same prompt as with tools under tool_choice "none" (no grammar): what the longer prompt costs by itself.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

MAX_SEQ_LEN = 8192
TOOL_COUNT = 20


def _tools(count: int) -> list[dict]:
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 999},
             {"enum": ["low", "mid", "high"]}, {"type": "boolean"}]
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Function number {i}",
        "parameters": {"type": "object", "properties": {"x": kinds[i % 4], "y": kinds[(i + 1) % 4]},
                       "required": ["x", "y"], "additionalProperties": False}}} for i in range(count)]


def _valid(calls, schemas) -> bool:
    import jsonschema

    try:
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
    except (KeyError, json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return bool(calls)


def _validity(client, service, tools, requests: int) -> dict:
    from benchmarks.tool_model import TEMPLATES, use_format
    from backends.mlx.llm.decoder.tool_output import ToolOutput

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ask = [{"role": "user", "content": "Call a function."}]
    out = {}
    for fmt in TEMPLATES:
        use_format(service, fmt)
        constrained = free = 0
        for seed in range(requests):
            answer = client.chat.completions.create(model="tools", messages=ask, tools=tools, tool_choice="required",
                                                    parallel_tool_calls=False, seed=seed, temperature=1.0,
                                                    max_tokens=200).choices[0].message
            constrained += _valid([(c.function.name, c.function.arguments) for c in answer.tool_calls or []], schemas)
            text = client.chat.completions.create(model="tools", messages=ask, tools=tools, tool_choice="none",
                                                  seed=seed, temperature=1.0, max_tokens=60).choices[0].message.content
            _, calls = ToolOutput(fmt, set(schemas)).split(text or "")
            free += _valid([(c.call.name, c.call.arguments_json) for c in calls], schemas)
        out[fmt] = {"constrained_valid": constrained / requests, "unconstrained_valid": free / requests}
        print(f"{fmt:12s} valid calls: constrained {constrained}/{requests}, unconstrained {free}/{requests}",
              flush=True)
    return out


def _ttft(client, tools, repeats: int, rounds: int = 3) -> dict:
    """Median latency of a max_tokens=1 request with and without the tools, in alternating blocks (so that a busy
    machine slows both alike); each block starts with a warm-up (it fills the prompt cache: the engine gives a new
    request the row with the longest common prefix, so the two prompts, which share their first tokens, take the
    same row in turn; with tools it also compiles the grammar once, which the server then keeps)."""
    ask = [{"role": "user", "content": "What is the weather like today?"}]
    # the third case: the same prompt as with tools, no grammar (what the longer prompt costs by itself)
    cases = {"no tools": {}, f"{len(tools)} tools": {"tools": tools},
             f"{len(tools)} tools, tool_choice none": {"tools": tools, "tool_choice": "none"}}
    samples = {label: [] for label in cases}
    answers = {}
    for _ in range(rounds):
        for label, extra in cases.items():
            for i in range(max(1, repeats // rounds) + 1):
                start = time.perf_counter()
                answers[label] = client.chat.completions.create(model="tools", messages=ask, max_tokens=1, seed=i,
                                                                **extra)
                if i:
                    samples[label].append(time.perf_counter() - start)
    times = {label: {"median_s": statistics.median(samples[label]), "prompt_tokens": a.usage.prompt_tokens,
                     "cached_tokens": a.usage.prompt_tokens_details.cached_tokens} for label, a in answers.items()}
    base, tooled, unconstrained = (times[k]["median_s"] for k in times)
    for label, t in times.items():
        print(f"TTFT {label:30s}: {t['median_s'] * 1e3:7.1f} ms ({t['prompt_tokens']} prompt tokens, "
              f"{t['cached_tokens']} from the cache)", flush=True)
    print(f"TTFT ratio same prompt, no grammar / no tools: {unconstrained / base:.2f}", flush=True)
    print(f"TTFT ratio {len(tools)} tools / no tools: {tooled / base:.2f} (target <= 1.2)", flush=True)
    return {**times, "ratio": tooled / base}


def main(cache_dir: str, json_path: str | None = None, requests: int = 50, repeats: int = 30, *, hidden: int = 32,
         layers: int = 1, batch: int = 4, max_seq_len: int = MAX_SEQ_LEN) -> int:
    import openai

    from backends.mlx.serve.app import ServerThread
    from benchmarks.tool_model import export_tool_model, use_format

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    pte = cache / f"tools-h{hidden}-l{layers}-b{batch}-s{max_seq_len}.pte"
    if not pte.is_file():
        print(f"exporting the tiny tool program to {pte}", flush=True)
        export_tool_model(pte, max_seq_len, batch=batch, hidden=hidden, layers=layers)
    server = ServerThread(pte, model_name="tools").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        tools = _tools(TOOL_COUNT)
        result = {"validity": _validity(client, server.service, tools[:4], requests)}
        use_format(server.service, "hermes")
        result["ttft"] = _ttft(client, tools, repeats)
    finally:
        server.stop()
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return 0
