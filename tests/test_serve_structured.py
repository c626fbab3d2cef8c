"""Structured output in the server: request fields -> Constraint, the engine's per-row masks, errors."""

from __future__ import annotations

import json
import re
import threading

import pytest

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method
from backends.mlx.serve.api_errors import ApiError
from backends.mlx.serve.engine import Engine, EngineRequest
from backends.mlx.serve.structured_params import constraint_from_body

pytestmark = pytest.mark.slow  # two decoder exports, batched engine runs

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["x", "y"]}},
          "required": ["n", "c"], "additionalProperties": False}


@pytest.mark.parametrize("body, kind, spec", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, "json_schema",
     SCHEMA),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", "start: \"a\""),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
])
def test_request_fields(body, kind, spec):
    c = constraint_from_body(body)
    assert (c is None and kind is None) or (c.kind, c.spec) == (kind, spec)


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
])
def test_bad_request_fields_are_400s(body, needle):
    with pytest.raises(ApiError, match=re.escape(needle)) as info:
        constraint_from_body(body)
    assert info.value.status == 400 and info.value.param in ("response_format", "structured_outputs")


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
    out = tmp_path_factory.mktemp("serve_structured")
    masked, plain = out / "masked.pte", out / "plain.pte"
    export_decoder(model, masked, 96, batch=4, config=SamplerConfig(top_k=True, allowed_mask=True), tokenizer=tok)
    export_decoder(model, plain, 32, batch=2, config=SamplerConfig(top_k=True), tokenizer=tok)
    return masked, plain, tok


def _engine(pte):
    meta = DecoderMeta.load(pte)
    return Engine(load_method(pte), meta, pte=pte).start()


def _run(engine, specs):
    """Submit every (prompt, params, constraint) at once; their token lists (None for an error)."""
    done = [threading.Event() for _ in specs]
    results = [[] for _ in specs]

    def sink(i):
        def on(event):
            if event.token is not None:
                results[i].append(event.token)
            if event.finish_reason:
                if event.finish_reason == "error":
                    results[i] = None
                done[i].set()
        return on

    for i, (prompt, params, constraint) in enumerate(specs):
        engine.submit(EngineRequest(prompt, params, 60, sink(i), constraint=constraint))
    for d in done:
        assert d.wait(120)
    return results


def test_rows_with_and_without_constraints_give_their_solo_results(programs):
    masked, _, tok = programs
    engine = _engine(masked)
    try:
        specs = [(tok("Hi")["input_ids"], SamplingParams(temperature=1.0, seed=1), Constraint("json_schema", SCHEMA)),
                 (tok("Hello there")["input_ids"], SamplingParams(temperature=0.8, seed=2), None),
                 (tok("A")["input_ids"], SamplingParams(temperature=1.0, seed=3, top_k=5),
                  Constraint("regex", r"[0-9]{3}-[a-z]{2}")),
                 (tok("Hi")["input_ids"], SamplingParams(), Constraint("choice", ["yes", "no"]))]
        solo = [_run(engine, [spec])[0] for spec in specs]
        together = _run(engine, specs)
    finally:
        engine.stop()
    assert together == solo
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)
    value = json.loads(text(solo[0]))
    assert set(value) == {"n", "c"} and value["c"] in ("x", "y")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(solo[2])) and text(solo[3]) in ("yes", "no")
    assert solo[1][-1] != tok.eos_token_id or len(solo[1]) < 60  # unconstrained: the model's own tokens


def test_bad_constraint_and_program_without_mask_are_refused_before_running(programs):
    masked, plain, tok = programs
    engine = _engine(masked)
    try:
        with pytest.raises(ConstraintError, match="invalid regex"):
            engine.check(EngineRequest([1], SamplingParams(), 4, lambda e: None, constraint=Constraint("regex", "(")))
        with pytest.raises(ConstraintError, match="invalid json_schema"):
            engine.check(EngineRequest([1], SamplingParams(), 4, lambda e: None,
                                       constraint=Constraint("json_schema", {"type": "object", "required": 5})))
    finally:
        engine.stop()
    engine = _engine(plain)
    try:
        with pytest.raises(ConstraintError, match="exported without the allowed-token mask"):
            engine.check(EngineRequest([1], SamplingParams(), 4, lambda e: None, constraint=Constraint("json_object")))
    finally:
        engine.stop()
