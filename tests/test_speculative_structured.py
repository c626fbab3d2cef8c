"""Structured output on a draft-verifying program (`--draft-tokens K` with the mask input): each verified position
is sampled under its own mask (the grammar after the drafts before it), drafts are cut where the grammar rejects
one, and accepted drafts advance the grammar. So the tokens are the plain mask program's, greedy and seeded, with
every draft source, and the output parses; a prediction that matches is accepted."""

from __future__ import annotations

import json

import pytest

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.constraints import Constraint
from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams

pytestmark = pytest.mark.slow  # decoder exports

K = 4
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "size"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}}}
CONSTRAINTS = {"json_schema": Constraint("json_schema", SCHEMA), "regex": Constraint("regex", r"[a-c]{2,6}-[0-9]{1,4}")}


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
    out = tmp_path_factory.mktemp("speculative_structured")
    config = SamplerConfig(top_k=True, top_p=True, allowed_mask=True)
    export_decoder(model, out / "masked.pte", 96, config=config, tokenizer=tok)
    export_decoder(model, out / "draft.pte", 96, config=config, tokenizer=tok, draft_tokens=K)  # checked on export
    return Decoder(out / "masked.pte"), SpeculativeDecoder(out / "draft.pte"), tok


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=5, top_p=0.95)],
                         ids=["greedy", "seeded"])
def test_drafted_structured_output_is_the_plain_mask_programs(programs, name, params):
    plain, draft, tok = programs
    prompt = tok("Hello there")["input_ids"]
    constraint = CONSTRAINTS[name]
    reference = plain.generate(prompt, 60, params, constraint=constraint).tokens
    text = tok.decode(reference, skip_special_tokens=True)
    if name == "json_schema" and reference[-1] == tok.eos_token_id:
        assert json.loads(text)["color"] in ("red", "green", "blue")
    edited = [t if i % 5 != 3 else (t + 1) % len(tok) for i, t in enumerate(reference)]  # some drafts wrong
    accepted = {}
    for source_name, source in {"none": None, "ngram": NgramDraft(), "prediction": PredictionDraft(reference),
                                "edited prediction": PredictionDraft(edited)}.items():
        tokens = list(draft.stream(prompt, 60, params, draft=source, constraint=constraint))
        assert tokens == reference, (name, source_name)
        accepted[source_name] = (draft.stats.accepted, draft.stats.proposed)
    assert accepted["none"] == (0, 0)
    hit, proposed = accepted["prediction"]
    assert hit == proposed > 0 and draft.stats.calls < len(reference)  # several tokens a call
    assert accepted["edited prediction"][0] > 0


def test_drafts_the_grammar_rejects_are_cut_before_the_call(programs):
    """A prediction that breaks the grammar at once proposes nothing the grammar rejects: its drafts stop at the
    first one the grammar does not allow, and the output is still the plain one."""
    plain, draft, tok = programs
    prompt = tok("Hello there")["input_ids"]
    constraint = CONSTRAINTS["regex"]
    reference = plain.generate(prompt, 30, SamplingParams(), constraint=constraint).tokens
    wrong = tok("zzzz zzzz")["input_ids"]  # 'z' never matches [a-c]
    tokens = list(draft.stream(prompt, 30, SamplingParams(), draft=PredictionDraft(wrong + reference),
                               constraint=constraint))
    assert tokens == reference


def test_cli_generate_constrains_a_draft_program(programs, capsys):
    """`etmlx generate --regex R` on a draft program (prompt lookup by default, or --prediction): the plain mask
    program's tokens, and --json reports the drafts."""
    from backends.mlx.cli.main import main

    plain, draft, tok = programs
    ids = ",".join(map(str, tok("Hello there")["input_ids"]))

    def run(pte, *flags):
        assert main(["generate", str(pte), "--prompt-ids", ids, "-m", "40", "--regex", "[a-c]{2,6}-[0-9]{1,4}",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    reference = run(plain.pte)
    assert "draft" not in reference
    for flags in ([], ["--prediction", ",".join(map(str, reference["tokens"]))]):
        out = run(draft.pte, *flags)
        assert out["tokens"] == reference["tokens"], flags
        if flags:
            assert out["draft"]["accepted"] == out["draft"]["proposed"] > 0
