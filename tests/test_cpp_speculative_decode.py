"""build/etmlx_decode drives draft-verifying programs (`--draft-tokens K`) with the draft sources and budget of
the C++ core (runtime/draft_sources.h), the ones the Python engine runs through ctypes: with every source (prompt
lookup, a predicted output, an edited one, none) its tokens are the plain program's, greedy and seeded with
filters, and its draft counts are exactly the Python SpeculativeDecoder's (one implementation of the sources and
of the budget). Draft flags on a plain program, or too many drafts, are one-line errors."""

from __future__ import annotations

import pytest

from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import etmlx_decode_json, tiny_llama

pytestmark = pytest.mark.slow  # whole decoder exports

VOCAB = 96
K = 4
PROMPT = [5, 17, 3, 40, 8, 5, 17, 3, 40, 9]
N = 32
CONFIG = SamplerConfig(top_k=True, top_p=True)
SEEDED = (SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9),
          ["--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9"])


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict:
    model = tiny_llama(VOCAB, seed=7, head_scale=0.3)
    out = tmp_path_factory.mktemp("cpp_speculative")
    paths = {"plain": out / "plain.pte", "draft": out / "draft.pte"}
    export_decoder(model, paths["plain"], 64, config=CONFIG)
    export_decoder(model, paths["draft"], 64, config=CONFIG, draft_tokens=K)
    return paths


def _decode(pte, *flags, check=True):
    return etmlx_decode_json(pte, PROMPT, N, *flags, check=check)


def _edited(reference):
    wrong = list(reference)
    for i in range(3, len(wrong), 7):  # right in runs, wrong every 7th token
        wrong[i] = (wrong[i] + 1) % VOCAB
    return wrong


@pytest.mark.parametrize("seeded", [False, True])
def test_draft_program_gives_the_plain_tokens_and_the_python_draft_counts(programs, seeded):
    params, flags = SEEDED if seeded else (SamplingParams(), [])
    plain = _decode(programs["plain"], *flags)["tokens"]
    assert plain == [e.token for e in Decoder(programs["plain"]).stream(PROMPT, N, params, stop_at_eos=False)]
    python = SpeculativeDecoder(programs["draft"])
    ids = lambda tokens: ",".join(map(str, tokens))  # noqa: E731
    cases = {
        "ngram": (["--draft", "ngram"], NgramDraft()),
        "default (ngram)": ([], NgramDraft()),
        "prediction": (["--prediction-ids", ids(plain)], PredictionDraft(plain)),
        "edited prediction": (["--prediction-ids", ids(_edited(plain))], PredictionDraft(_edited(plain))),
        "none": (["--draft", "none"], None),
    }
    counts = {}
    for name, (source_flags, source) in cases.items():
        out = _decode(programs["draft"], *flags, *source_flags)
        assert out["tokens"] == plain, name
        tokens = list(python.stream(PROMPT, N, params, draft=source, stop_at_eos=False))
        assert tokens == plain, name
        stats = python.stats
        assert out["draft"] == {"proposed": stats.proposed, "accepted": stats.accepted, "calls": stats.calls}, name
        counts[name] = out["draft"]
    # The sources were exercised: an exact prediction is accepted in full, K + 1 tokens a call; an edited one
    # in part; none proposes nothing and makes a call per token (and one more: the program is pipelined, so
    # its first token comes with its second call).
    assert counts["prediction"]["accepted"] == counts["prediction"]["proposed"] == N - counts["prediction"]["calls"]
    assert counts["prediction"]["calls"] == -(-N // (K + 1))
    assert 0 < counts["edited prediction"]["accepted"] < counts["edited prediction"]["proposed"]
    assert counts["none"] == {"proposed": 0, "accepted": 0, "calls": N + 1}


def test_fewer_drafts_per_call(programs):
    plain = _decode(programs["plain"])["tokens"]
    ids = ",".join(map(str, plain))
    two = _decode(programs["draft"], "--prediction-ids", ids, "--num-draft-tokens", "2")
    assert two["tokens"] == plain
    assert two["draft"]["accepted"] == two["draft"]["proposed"] and two["draft"]["calls"] >= N // 3
    zero = _decode(programs["draft"], "--prediction-ids", ids, "--num-draft-tokens", "0")
    assert zero["tokens"] == plain and zero["draft"]["proposed"] == 0


@pytest.mark.parametrize("which, flags, message", [
    ("plain", ["--draft", "ngram"], "does not verify drafts: export it with --draft-tokens K"),
    ("plain", ["--prediction-ids", "1,2"], "does not verify drafts"),
    ("draft", ["--num-draft-tokens", str(K + 1)], f"--num-draft-tokens must be 0..{K}"),
    ("draft", ["--prediction-ids", f"1,{VOCAB}"], f"prediction token ids must be in [0, {VOCAB})"),
    ("draft", ["--prediction-ids", "1,-2"], "--prediction-ids must be token ids >= 0"),
    ("draft", ["--draft", "ngram", "--prediction-ids", "1"], "give one draft source"),
    ("draft", ["--draft", "eagle"], "--draft must be ngram or none"),
    ("draft", ["--prediction", "some text"], "needs the program's tokenizer"),
])
def test_bad_draft_flags_are_one_line_errors(programs, which, flags, message):
    done = _decode(programs[which], *flags, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert message in lines[0] and lines[0].startswith("etmlx_decode: error:"), lines
