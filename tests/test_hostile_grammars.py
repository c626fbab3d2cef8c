"""Hostile grammars (issue 23): a $ref chain that overflows llguidance's stack, grammars that take
seconds or a gigabyte to compile, grammars that allow nothing. Each fails alone with a one-line error
naming the problem (HTTP 400, an LMTP stream error, CLI exit 2), never a crash, a stall or a 500;
good requests beside them get exactly their solo tokens, and /health answers while a big grammar compiles.
The $ref chain is 2,500 definitions long: the size at which llguidance crashes a process (shown first)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import aiohttp
import numpy as np
import pytest

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError, GrammarVocabulary
from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.serve.app import ServeLimits, ServerThread
from run_once import exclusive, shared_dir
from serve_helpers import bit_exact_batching

CHAIN = 2500  # $ref definitions: llguidance overflows an 8 MiB stack at this length
LARK_CHAIN = 10_000  # Lark rules, each only naming the next: the same overflow from a Lark grammar
LEAKS = ("panicked", "backtrace", "RUST_BACKTRACE", "Traceback", "<state>", "\n")


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


NOTHING = [  # grammars that allow no output at all
    Constraint("regex", r"[^\s\S]"),
    Constraint("grammar", 'start: a\na: a "x"\n'),
    Constraint("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
]
TREE = {"type": "object", "properties": {"v": {"type": "integer"},  # recursion behind a property: legitimate
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}
RAISED = dict(max_ref_depth=10**6, max_schema_bytes=1 << 22, max_grammar_bytes=1 << 24, max_choices=10**6)


def _one_line_no_leak(message: str) -> None:
    assert message and not any(leak in message for leak in LEAKS), message


# ---- the limits: checked in Python before llguidance sees the grammar ----

@pytest.mark.parametrize("constraint, flag", [
    (Constraint("json_schema", {"enum": ["x" * 1000] * 300}), "--max-schema-bytes"),
    (Constraint("json_schema", json.dumps({"enum": ["x" * 1000] * 300})), "--max-schema-bytes"),
    (Constraint("json_schema", {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}),
     "--max-schema-depth"),
    (Constraint("json_schema", ref_chain(65)), "--max-ref-depth"),
    (Constraint("json_schema", ref_chain(CHAIN)), "--max-ref-depth"),
    (Constraint("choice", [f"c{i}" for i in range(4097)]), "--max-choices"),
    (Constraint("regex", "a" * 600_000), "--max-grammar-bytes"),
])
def test_each_limit_is_a_one_line_error_naming_its_flag(constraint, flag):
    with pytest.raises(ConstraintError) as info:
        constraint.grammar(GrammarLimits())
    assert flag in str(info.value)
    _one_line_no_leak(str(info.value))


def test_within_the_limits_passes_the_checks():
    limits = GrammarLimits()
    for constraint in (Constraint("json_schema", ref_chain(63)), Constraint("json_schema", TREE),
                       Constraint("choice", [f"c{i}" for i in range(4096)])):
        assert constraint.grammar(limits)
    with pytest.raises(ValueError, match="--max-choices must be > 0"):
        GrammarLimits(max_choices=0).check()


def test_a_library_panic_becomes_one_plain_line():
    from backends.mlx.llm.decoder.grammar_limits import one_line

    panic = "thread '<unnamed>' panicked at src/earley/parser.rs:1:2:\nindex out of bounds\nstack backtrace:\n 0: x"
    _one_line_no_leak(one_line(panic))
    assert one_line("line one\n  line two") == "line one line two"


# ---- the isolated compile ----

@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_json(tokenizer):
    return tokenizer.backend_tokenizer.to_str()


def _vocabulary(tokenizer, tokenizer_json, **limits) -> GrammarVocabulary:
    return GrammarVocabulary(tokenizer_json, len(tokenizer), [tokenizer.eos_token_id], GrammarLimits(**limits))


def test_the_ref_chain_crashes_a_process_that_compiles_it_unguarded(tokenizer, tokenizer_json, tmp_path):
    """The attack is real at this size: llguidance on the main thread dies with SIGSEGV."""
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "schema.json").write_text(json.dumps(ref_chain(CHAIN)))
    code = ("import json, sys; from llguidance import LLMatcher, LLTokenizer\n"
            f"tok = LLTokenizer(open(sys.argv[1]).read(), n_vocab={len(tokenizer)}, eos_token=[{tokenizer.eos_token_id}])\n"
            "LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.load(open(sys.argv[2]))), tok)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tokenizer.json"), str(tmp_path / "schema.json")],
                          capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGSEGV


def _first_mask(vocabulary, constraint) -> np.ndarray:
    return vocabulary.matcher(constraint).mask().copy()


@pytest.mark.parametrize("constraint, limits, needle", [
    (Constraint("json_schema", ref_chain(CHAIN)), RAISED, "ran out of stack"),
    (Constraint("grammar", lark_chain(LARK_CHAIN)), RAISED, "ran out of stack"),
    (Constraint("choice", [f"item{i}" for i in range(200_000)]), dict(RAISED, grammar_memory_mb=128),
     "--grammar-memory-mb"),
    (Constraint("choice", [f"item{i}" for i in range(50_000)]), dict(RAISED, grammar_compile_timeout=0.5),
     "--grammar-compile-timeout"),
    *[(c, {}, "allows nothing") for c in NOTHING],
])
def test_a_hostile_grammar_fails_alone_while_good_ones_compile(tokenizer, tokenizer_json, constraint, limits,
                                                              needle):
    """The attack runs in a worker process beside good compiles (threads): it fails with one line, this
    process lives, and the good grammars' masks are exactly what they are alone."""
    vocabulary = _vocabulary(tokenizer, tokenizer_json, **limits)
    goods = [Constraint("json_schema", TREE), Constraint("regex", "[0-9]{3}-[a-z]{2}"), Constraint("choice", ["yes", "no"])]
    try:
        solo = [_first_mask(vocabulary, c) for c in goods]
        results, errors = {}, []

        def attack():
            try:
                vocabulary.matchers(constraint, 2)
            except ConstraintError as exc:
                errors.append(str(exc))

        def good(i):
            results[i] = _first_mask(vocabulary, goods[i])

        threads = [threading.Thread(target=attack)] + [threading.Thread(target=good, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(errors) == 1 and needle in errors[0], errors
        _one_line_no_leak(errors[0])
        assert all(np.array_equal(results[i], solo[i]) for i in range(3))
        vocabulary.checker._proven.clear()  # the pool replaced its dead worker: a fresh compile still works
        assert np.array_equal(_first_mask(vocabulary, goods[1]), solo[1])
    finally:
        vocabulary.close()


def test_a_choice_list_longer_than_llguidance_row_limit_completes(tokenizer, tokenizer_json):
    """llguidance refuses a grammar row over 2,000 items at the first token, after its mask allowed it
    (the issue's 500 "the grammar rejected token 79"): the row limit follows --max-choices instead."""
    choices = [f"item{i}" for i in range(2500)]
    vocabulary = _vocabulary(tokenizer, tokenizer_json)
    try:
        matcher = vocabulary.matcher(Constraint("choice", choices))
        taken = []
        while not matcher.accepting:
            bits = np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")
            token = int(np.flatnonzero(bits[:len(tokenizer)])[-1])  # the highest allowed id: a long merge
            matcher.advance(token)
            taken.append(token)
        assert tokenizer.decode(taken) in choices
    finally:
        vocabulary.close()


# ---- a mask program: the server and the CLI ----

@pytest.fixture(scope="module")
def masked_pte(tmp_path_factory, tokenizer):
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    directory = shared_dir(tmp_path_factory, "hostile_grammars")
    path = directory / "masked.pte"
    with exclusive(directory):
        if not path.is_file():
            model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, layers=1)
            export_decoder(model, path, 96, batch=4, config=SamplerConfig(top_k=True, allowed_mask=True, logprobs=2),
                           tokenizer=tokenizer)
    return path


@pytest.mark.parametrize("flag, text, needle", [
    ("--json-schema", json.dumps(ref_chain(CHAIN)), "--max-ref-depth"),
    ("--grammar", lark_chain(LARK_CHAIN), "ran out of stack"),  # past the checks: the worker crashes, not etmlx
    ("--regex", r"[^\s\S]", "allows nothing"),
])
def test_cli_exits_2_with_one_line(masked_pte, tmp_path, flag, text, needle):
    if flag == "--regex":
        value = text
    else:
        (tmp_path / "g").write_text(text)
        value = str(tmp_path / "g")
    done = subprocess.run([sys.executable, "-m", "etmlx", "generate", str(masked_pte), "--prompt-ids", "1,2",
                           "--max-tokens", "4", flag, value], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("etmlx: error:") and needle in last and "Traceback" not in done.stderr, done.stderr


SERVER_LIMITS = GrammarLimits(**dict(RAISED, max_choices=50_000, grammar_compile_timeout=60, grammar_memory_mb=2048))


@pytest.fixture(scope="module")
def server(masked_pte):
    with bit_exact_batching():
        srv = ServerThread(masked_pte, model_name="tiny", lmtp_port=0,
                           limits=ServeLimits(grammar=SERVER_LIMITS)).start()
    yield srv
    srv.stop()


def _completion(prompt, seed, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": seed, "logprobs": 0, **extra}


GOOD = [_completion([1, 5, 9], 3),
        _completion([2, 4], 5, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}),
        _completion([7], 7, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": TREE}}),
        _completion([3, 3], 9, n=2, structured_outputs={"choice": ["yes", "no", "maybe"]})]
ATTACKS = [({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": ref_chain(CHAIN)}}},
            "ran out of stack"),
           ({"structured_outputs": {"grammar": lark_chain(LARK_CHAIN)}}, "ran out of stack"),
           ({"structured_outputs": {"choice": [f"c{i}" for i in range(50_001)]}}, "--max-choices"),
           *[({"structured_outputs": {"regex": c.spec}} if c.kind == "regex" else
              {"structured_outputs": {"grammar": c.spec}} if c.kind == "grammar" else
              {"structured_outputs": {"json": c.spec}}, "allows nothing") for c in NOTHING]]


async def _post(http, url, body):
    async with http.post(url + "/v1/completions", json=body) as response:
        return response.status, await response.json()


def _tokens(out) -> list:
    return [choice["logprobs"]["tokens"] for choice in out["choices"]]


pytest_server = pytest.mark.server


@pytest_server
def test_server_attacks_fail_alone_while_good_requests_get_their_solo_tokens(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            solo = []
            for body in GOOD:
                status, out = await _post(http, server.url, body)
                assert status == 200, out
                solo.append(_tokens(out))
            attacks = [_post(http, server.url, _completion([1], 1, **fields)) for fields, _ in ATTACKS]
            goods = [_post(http, server.url, body) for body in GOOD]
            results = await asyncio.gather(*attacks, *goods)
            for (status, out), (_, needle) in zip(results, ATTACKS):
                assert status == 400 and needle in out["error"]["message"], out
                assert out["error"]["type"] == "invalid_request_error"
                _one_line_no_leak(out["error"]["message"])
            for (status, out), alone in zip(results[len(ATTACKS):], solo):
                assert status == 200 and _tokens(out) == alone, out
            async with http.get(server.url + "/health") as response:
                assert response.status == 200
    asyncio.run(main())


@pytest_server
def test_health_and_other_clients_are_served_during_a_big_compile(server):
    big = _completion([1], 1, n=4, structured_outputs={"choice": [f"item{i}" for i in range(20_000)]})

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            status, out = await _post(http, server.url, GOOD[0])
            alone = _tokens(out)
            task = asyncio.ensure_future(_post(http, server.url, big))
            await asyncio.sleep(0.05)  # the big request is in (its compile takes seconds)
            async with http.get(server.url + "/health") as response:
                assert response.status == 200
            health_before_big = not task.done()
            status, out = await _post(http, server.url, GOOD[0])
            other_before_big = not task.done()
            assert status == 200 and _tokens(out) == alone
            status, out = await task
            assert status == 200 and all(c["text"].startswith("item") for c in out["choices"]), out
            assert health_before_big and other_before_big
    asyncio.run(main())


@pytest_server
def test_a_grammar_failing_mid_generation_is_a_400(server, monkeypatch):
    """The matcher this process builds hits a parser limit at its first step (the worker's did not:
    it has llguidance's defaults): a client's grammar, so a 400 with one line, not a 500."""
    from llguidance import LLParserLimits

    import backends.mlx.llm.decoder.constraints as constraints

    monkeypatch.setattr(constraints, "parser_limits", lambda _choices: LLParserLimits(step_max_items=3, verbose_errors=False))

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            body = _completion([2], 4, structured_outputs={"json": {"type": "object", "properties": {
                "a": {"type": "array", "items": {"type": "string"}}}, "required": ["a"]}})
            return await _post(http, server.url, body)
    status, out = asyncio.run(main())
    assert status == 400 and "the request's grammar failed during generation" in out["error"]["message"], out
    _one_line_no_leak(out["error"]["message"])


@pytest_server
def test_lmtp_stream_error_for_the_ref_chain_and_the_connection_goes_on(server):
    async def main():
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "/lmtp") as ws:
            good = {"stream_id": "g", "prompt": [2, 4], "max_tokens": 12, "temperature": 1.0, "seed": 5,
                    "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
            attack = {"stream_id": "a", "prompt": [1], "max_tokens": 4,
                      "response_format": {"type": "json_schema", "json_schema": {"schema": ref_chain(CHAIN)}}}
            tokens = {"g": [], "a": []}
            errors = []
            for line in [good, attack, dict(good, stream_id="h")]:
                await ws.send_str("GENERATE " + json.dumps(line))
            tokens["h"] = []
            finished = set()
            while finished != {"g", "h", "a"}:
                kind, _, data = (await asyncio.wait_for(ws.receive_str(), 120)).partition(" ")
                for entry in json.loads(data):
                    if entry.get("token") is not None:
                        tokens[entry["stream_id"]].append(entry["token"])
                    if entry.get("error"):
                        errors.append((entry["stream_id"], entry["error"]))
                    if entry.get("finish_reason"):
                        finished.add(entry["stream_id"])
            return tokens, errors
    tokens, errors = asyncio.run(main())
    assert len(errors) == 1 and errors[0][0] == "a" and "ran out of stack" in errors[0][1]
    _one_line_no_leak(errors[0][1])
    assert tokens["g"] == tokens["h"] and tokens["g"]


@pytest_server
def test_lmtp_tcp_line_over_the_limit_gets_an_error_line_before_the_close(server, caplog):
    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.server.lmtp_port, limit=1 << 20)
        writer.write(b"GENERATE " + b"x" * (5 * 1024 * 1024) + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 60)
        rest = await asyncio.wait_for(reader.read(), 60)
        writer.close()
        return line, rest
    with caplog.at_level("DEBUG"):
        line, rest = asyncio.run(main())
    kind, _, data = line.decode().partition(" ")
    assert kind == "MSG" and "longer than the limit" in json.loads(data)["error"] and rest == b""
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]
