"""Structured output through the Decoder: llguidance masks on the host, the mask applied on the device.

A random-weight tiny Llama (its output is noise) sampled at temperature 1.0: every completion must
still parse and match, so only the mask can make it so.
"""

from __future__ import annotations

import json
import re

import pytest

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams

RUNS = 200
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "size", "ok", "tags"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 12},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}}}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta", "é日本"]


def _valid(value) -> bool:
    """SCHEMA checked by hand (no JSON-schema validator is a dependency here)."""
    p = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and value["color"] in p["color"]["enum"]
            and type(value["size"]) is int and 0 <= value["size"] <= 12
            and type(value["ok"]) is bool
            and isinstance(value["tags"], list) and 1 <= len(value["tags"]) <= 3
            and all(t in ("a", "b") for t in value["tags"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
    out = tmp_path_factory.mktemp("constraints")
    masked = out / "masked.pte"
    export_decoder(model, masked, 96, config=SamplerConfig(top_k=True, top_p=True, allowed_mask=True),
                   tokenizer=tok)
    plain = out / "plain.pte"
    export_decoder(model, plain, 32, config=SamplerConfig(top_k=True), tokenizer=tok)
    return Decoder(masked), tok, plain


def _texts(decoder, tok, constraint, runs=RUNS, complete=True, **knobs):
    """Texts of `runs` seeded completions; with `complete`, each must have ended with EOS (bounded output)."""
    prompt = tok("Hello there")["input_ids"]
    out = []
    for run in range(runs):
        # seed + step per step: base seeds far apart so that no two runs share a step's noise
        gen = decoder.generate(prompt, 80, SamplingParams(temperature=1.0, seed=run * 10 ** 6, **knobs),
                               constraint=constraint)
        assert gen.finish_reason == "stop" or not complete, (run, tok.decode(gen.tokens))
        if gen.finish_reason == "stop":
            out.append(tok.decode(gen.tokens, skip_special_tokens=True))
    return out


@pytest.mark.slow  # 200 constrained completions
def test_json_schema_completions_all_parse_and_validate(tiny):
    decoder, tok, _ = tiny
    texts = _texts(decoder, tok, Constraint("json_schema", SCHEMA))
    values = [json.loads(t) for t in texts]
    assert all(_valid(v) for v in values), [t for t, v in zip(texts, values) if not _valid(v)][:3]
    # temperature 1 on a random model: the constrained choices really vary
    assert len({v["color"] for v in values}) == 3 and len({v["size"] for v in values}) >= 8


def test_unconstrained_control_is_not_json(tiny):
    decoder, tok, _ = tiny
    prompt = tok("Hello there")["input_ids"]
    gen = decoder.generate(prompt, 40, SamplingParams(temperature=1.0, seed=1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(tok.decode(gen.tokens, skip_special_tokens=True))


def test_regex_and_choice_completions_all_match(tiny):
    decoder, tok, _ = tiny
    regex = _texts(decoder, tok, Constraint("regex", REGEX))
    assert all(re.fullmatch(REGEX, t) for t in regex), regex[:5]
    assert len(set(regex)) > 50
    choices = _texts(decoder, tok, Constraint("choice", CHOICES), top_p=0.95)
    assert set(choices) <= set(CHOICES) and len(set(choices)) >= 3, set(choices)


def test_lark_grammar_and_json_object(tiny):
    decoder, tok, _ = tiny
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    for text in _texts(decoder, tok, Constraint("grammar", lark), runs=20):
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text), text
    # free strings: a random model may not close one within the budget; every completion that ends does parse
    done = _texts(decoder, tok, Constraint("json_object"), runs=10, complete=False, top_k=5)
    assert len(done) >= 3 and all(isinstance(json.loads(t), dict) for t in done), done


def test_seeded_constrained_runs_are_reproducible(tiny):
    decoder, tok, _ = tiny
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    prompt = tok("Hi")["input_ids"]
    a = decoder.generate(prompt, 80, SamplingParams(temperature=0.9, seed=7), constraint=constraint).tokens
    b = decoder.generate(prompt, 80, SamplingParams(temperature=0.9, seed=7), constraint=constraint).tokens
    assert a == b


@pytest.mark.parametrize("constraint, needle", [
    (Constraint("regex", "(ab"), "regex"),
    (Constraint("json_schema", "{not json"), "json_schema is not valid JSON"),
    (Constraint("json_schema", {"type": "nonsense"}), "json_schema"),
    (Constraint("json_schema", [1]), "must be a JSON object"),
    (Constraint("choice", []), "non-empty list"),
    (Constraint("grammar", "start: undefined_rule"), "grammar"),
])
def test_bad_constraints_are_one_line_errors_before_decoding(tiny, constraint, needle):
    decoder, tok, _ = tiny
    with pytest.raises(ConstraintError, match=needle) as info:
        decoder.generate(tok("Hi")["input_ids"], 8, SamplingParams(), constraint=constraint)
    assert "\n" not in str(info.value)


def test_unknown_kind_and_program_without_the_mask(tiny):
    _, tok, plain = tiny
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        Constraint("xml")
    with pytest.raises(ConstraintError, match="--sampler .*mask"):
        Decoder(plain).generate(tok("Hi")["input_ids"], 8, constraint=Constraint("regex", "a+"))


def test_generate_cli_flags(tiny, tmp_path, capsys):
    from backends.mlx.cli.main import main

    decoder, _, _ = tiny
    pte = str(decoder.pte)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = [pte, "--prompt-ids", "5,6,7", "-m", "80", "--temp", "1.0", "--json"]
    for flag, check in ((["--json-schema", str(schema)], lambda t: _valid(json.loads(t))),
                        (["--regex", REGEX], lambda t: re.fullmatch(REGEX, t)),
                        (["--choice", ",".join(CHOICES)], lambda t: t in CHOICES)):
        for seed in ("1", "2000000"):
            assert main(["generate", *common, "--seed", seed, *flag]) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["finish_reason"] == "stop" and check(out["text"]), (flag, out["text"])
    assert main(["generate", *common, "--regex", "(ab"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("etmlx: error: invalid regex") and "\n" not in err
    assert main(["generate", *common, "--grammar", str(tmp_path / "missing.lark")]) == 2
    assert "cannot read" in capsys.readouterr().err
