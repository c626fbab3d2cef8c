"""Speculative decoding through the Python API and `etmlx chat` (llm/decoder/speculation.py): a --draft-tokens
program loaded with etmlx.load gives the plain program's tokens and text with every draft source (prompt lookup,
none, a prediction as text or ids, fewer drafts), greedy and seeded, and counts its drafts on each Response; the
prompt cache works on it; chat over three turns prints the plain program's chat; draft options on a plain program
and bad ones are one-line errors."""

from __future__ import annotations

import io
import sys

import pytest

import etmlx
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder

pytestmark = pytest.mark.slow  # two decoder exports

K = 4
TEXT = "Mira went to the mill by the river. Mira went to the"
SEEDED = {"temperature": 0.8, "seed": 3, "top_k": 20}


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    from backends.mlx.llm.builtin.tiny_model import tiny_llama
    from backends.mlx.llm.builtin.tokenizer import train_tokenizer
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    docs = ["Mira went to the mill by the river.", "The miller gave Mira flour and plum cake.",
            "Where does Mira live? In the blue house."] * 8
    tokenizer = train_tokenizer(docs, vocab_size=300)
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, seed=3)
    out = tmp_path_factory.mktemp("speculative_api")
    paths = {"plain": out / "plain.pte", "draft": out / "draft.pte"}
    export_decoder(model, paths["plain"], 160, config=SamplerConfig(top_k=True), tokenizer=tokenizer)
    export_decoder(model, paths["draft"], 160, config=SamplerConfig(top_k=True), tokenizer=tokenizer,
                   draft_tokens=K, verify=False)  # compared with the verified plain program below
    return paths


def _run(model, prompt, n, **options):
    responses = list(etmlx.stream_generate(model, prompt, n, **options))
    return [r.token for r in responses], "".join(r.text for r in responses), responses[-1]


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_api_gives_the_plain_tokens_with_every_draft_source(programs, sampling):
    plain, draft = etmlx.load(programs["plain"]), etmlx.load(programs["draft"])
    assert isinstance(draft, SpeculativeDecoder)
    n = 30
    tokens, text, last = _run(plain, TEXT, n, **sampling)
    assert len(tokens) > 5 and last.proposed_draft_tokens == last.accepted_draft_tokens == 0
    for options in ({}, {"draft": "ngram"}, {"draft": "none"}, {"num_draft_tokens": 2}, {"prediction": tokens},
                    {"prediction": text}):
        got, got_text, got_last = _run(draft, TEXT, n, **options, **sampling)
        name = sorted(options) or "default"
        assert (got, got_text) == (tokens, text), name
        assert got_last.finish_reason == last.finish_reason, name
        assert 0 <= got_last.accepted_draft_tokens <= got_last.proposed_draft_tokens, name
        if options == {"draft": "none"}:
            # a pipelined program (the default) returns its first token with its second call
            assert got_last.proposed_draft_tokens == 0 and draft.stats.calls == len(tokens) + draft.meta.pipelined
        if "prediction" in options and isinstance(options["prediction"], list):  # exact: every draft accepted
            assert got_last.accepted_draft_tokens == got_last.proposed_draft_tokens == len(tokens) - draft.stats.calls
            assert draft.stats.calls <= -(-len(tokens) // (K + 1)) + 1
    assert etmlx.generate(draft, TEXT, n, prediction=text, **sampling) == text


def test_prompt_cache_on_a_draft_program(programs):
    """Three turns through one prompt cache: the plain program's tokens, each turn prefilling only its new part."""
    caches = {name: etmlx.make_prompt_cache(etmlx.load(path)) for name, path in programs.items()}
    turns = ["Where does Mira live?", " In the blue house.", " The miller gave Mira"]
    for i, turn in enumerate(turns):
        before = len(caches["draft"].tokens)
        got = {name: _run(cache.model, turn, 12, prompt_cache=cache) for name, cache in caches.items()}
        assert got["draft"][:2] == got["plain"][:2], f"turn {i}"
        assert caches["draft"].tokens == caches["plain"].tokens
        # all but the last reply token when a delivering call sampled it (never fed); all of them when an
        # undelivered call's token came back with one more call, which fed it (as the pipelined plain program)
        assert max(before - 1, 0) <= got["draft"][2].cached_tokens <= before
    assert got["draft"][2].proposed_draft_tokens > 0


def test_draft_options_are_one_line_errors(programs):
    plain, draft = etmlx.load(programs["plain"]), etmlx.load(programs["draft"])
    cases = [(plain, {"prediction": "the mill"}, "prediction needs a program exported with --draft-tokens K"),
             (plain, {"draft": "none", "num_draft_tokens": 2},
              "draft and num_draft_tokens needs a program exported with --draft-tokens K"),
             (draft, {"num_draft_tokens": K + 1}, f"num_draft_tokens must be 0..{K}"),
             (draft, {"num_draft_tokens": -1}, f"num_draft_tokens must be 0..{K}"),
             (draft, {"draft": "model"}, "draft must be one of ngram, none"),
             (draft, {"draft": "ngram", "prediction": "x"}, "give prediction or draft, not both"),
             (draft, {"prediction": [5, 10_000]}, r"prediction token ids must be in \[0, ")]
    for model, options, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            etmlx.generate(model, TEXT, 4, **options)
        assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="prediction must be text or a list of token ids"):
        etmlx.generate(draft, TEXT, 4, prediction=3.5)


def _chat(monkeypatch, capsys, *argv, lines):
    from backends.mlx.cli.main import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code = main(["chat", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chat_on_a_draft_program_prints_the_plain_chat(programs, monkeypatch, capsys):
    lines = ["Where does Mira live?", "Tell me about the mill.", "Where does Mira live?"]
    for sampling in ([], ["--temp", "0.8", "--seed", "3", "--top-k", "20"]):
        code, plain, _ = _chat(monkeypatch, capsys, str(programs["plain"]), "-m", "12", *sampling, lines=lines)
        assert code == 0 and plain.count("\n") >= 3 and plain.strip()
        assert "speculative" not in _
        code, spec, err = _chat(monkeypatch, capsys, str(programs["draft"]), "-m", "12", *sampling, lines=lines)
        assert code == 0 and spec == plain, sampling
        accepted, proposed = map(int, err.split("[speculative decoding: ")[1].split(" drafted")[0].split(" of "))
        assert 0 < proposed and 0 <= accepted <= proposed
        code, none, err = _chat(monkeypatch, capsys, str(programs["draft"]), "-m", "12", "--draft", "none",
                                *sampling, lines=lines)
        assert code == 0 and none == plain and "0 of 0 drafted tokens" in err
    code, _, err = _chat(monkeypatch, capsys, str(programs["plain"]), "--draft", "ngram", lines=["Hi"])
    assert code == 2 and err.strip() == (f"etmlx: error: --draft needs a program exported with --draft-tokens K; "
                                         f"{programs['plain']} verifies no drafts")
