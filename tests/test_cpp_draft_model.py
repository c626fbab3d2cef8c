"""`build/etmlx_decode --draft-model SMALL.pte` (tools/etmlx_decode/model_draft.h): a small plain program drafts
for a draft-verifying one in the C++ decode loop, as the Python API's DraftModel does. Its tokens are the plain
program's (greedy and seeded, with an unpipelined, a pipelined, a --propose-tokens and a poorly guessing draft
program), and with a
fixed cost its draft counts and its own calls are exactly the Python DraftModel's: one implementation of the
budget and its bookkeeping (runtime/draft_sources.h DraftModelPacing). The target's own weights as the draft
model make every greedy draft right; a draft program that cannot serve is a one-line error."""

from __future__ import annotations

import json

import pytest

from backends.mlx.llm.decoder.draft_model import DraftModel
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import etmlx_decode_json, tiny_llama

pytestmark = pytest.mark.slow  # whole decoder exports

VOCAB = 96
K = 4
PROMPT = [5, 17, 3, 40, 8, 5, 17, 3]
N = 40
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True)
SEEDED = (SamplingParams(temperature=0.8, seed=3), ["--temperature", "0.8", "--seed", "3"])


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict:
    llama = tiny_llama(VOCAB, 3, head_scale=0.3, hidden=32, layers=2)
    out = tmp_path_factory.mktemp("cpp-draft-model")
    paths = {name: out / f"{name}.pte" for name in ("spec", "plain", "pipelined", "proposer", "small", "other-vocab")}
    export_decoder(llama, paths["spec"], 64, config=CONFIG, draft_tokens=K)
    # The target's own weights as plain programs: the reference tokens, and a draft model that is always right.
    export_decoder(llama, paths["plain"], 64, config=CONFIG, pipelined=False)
    export_decoder(llama, paths["pipelined"], 64, config=CONFIG, pipelined=True)
    export_decoder(llama, paths["proposer"], 64, propose_tokens=K)  # a proposal in one call (proposer.py)
    small = tiny_llama(VOCAB, 7, head_scale=0.3, hidden=16, layers=1)  # a poor guesser
    export_decoder(small, paths["small"], 64, config=SamplerConfig(), pipelined=False)
    other = tiny_llama(64, 7, head_scale=0.3, hidden=16, layers=1)
    export_decoder(other, paths["other-vocab"], 64, config=SamplerConfig(), verify=False)
    return paths


def _decode(pte, *flags, check=True):
    return etmlx_decode_json(pte, PROMPT, N, *flags, check=check)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_draft_model_gives_the_plain_tokens_and_the_python_counts(programs, seeded):
    params, flags = SEEDED if seeded else (SamplingParams(), [])
    reference = [s.token for s in Decoder(programs["plain"]).stream(PROMPT, N, params, stop_at_eos=False)]
    target = SpeculativeDecoder(programs["spec"])
    for draft in ("plain", "pipelined", "proposer", "small"):
        out = _decode(programs["spec"], *flags, "--draft-model", str(programs[draft]), "--draft-model-cost", "0")
        assert out["tokens"] == reference, draft
        source = DraftModel(programs[draft], target=target, cost=0)
        assert list(target.stream(PROMPT, N, params, draft=source, stop_at_eos=False)) == reference, draft
        stats = target.stats
        assert out["draft"] == {"proposed": stats.proposed, "accepted": stats.accepted, "calls": stats.calls}, draft
        assert out["draft_model"]["calls"] == source.calls > 0, draft
        if draft != "small" and not seeded:  # the target's own weights: every greedy draft is right
            assert out["draft"]["accepted"] == out["draft"]["proposed"] > 0
            assert out["draft"]["calls"] <= -(-N // (K + 1)) + 1
        if draft == "proposer":  # one call per proposal, not one per draft
            assert out["draft_model"]["calls"] < out["draft"]["proposed"]
        if draft == "small":  # the control: a poor guesser has drafts rejected
            assert out["draft"]["accepted"] < out["draft"]["proposed"]


def test_a_costly_draft_model_only_probes(programs):
    """A draft call costing five target calls: the budget asks only for its rare probes, in both loops."""
    out = _decode(programs["spec"], "--draft-model", str(programs["plain"]), "--draft-model-cost", "5")
    cheap = _decode(programs["spec"], "--draft-model", str(programs["plain"]), "--draft-model-cost", "0")
    assert out["tokens"] == cheap["tokens"]
    assert out["draft"]["proposed"] < cheap["draft"]["proposed"] // 4


def test_a_measured_draft_model_gives_the_plain_tokens(programs):
    reference = _decode(programs["plain"])["tokens"]
    out = _decode(programs["spec"], "--draft-model", str(programs["pipelined"]))
    assert out["tokens"] == reference and out["draft_model"]["seconds"] > 0


@pytest.mark.parametrize("which, flags, message", [
    ("spec", ["--draft-model", "{other-vocab}"], "has a vocabulary of 64 tokens but the program has 96"),
    ("spec", ["--draft-model", "{spec}"], "verifies drafts itself (--draft-tokens 4)"),
    ("spec", ["--draft-model", "/nonexistent/small.pte"], "--draft-model /nonexistent/small.pte: no such file"),
    ("spec", ["--draft-model", "{garbage}"], "is not a loadable ExecuTorch program"),
    ("plain", ["--draft-model", "{small}"], "does not verify drafts: export it with --draft-tokens K"),
    ("spec", ["--draft-model", "{small}", "--draft", "ngram"], "give one draft source"),
    ("spec", ["--draft-model-cost", "1"], "--draft-model-cost needs --draft-model"),
    ("spec", ["--draft-model", "{small}", "--draft-model-cost", "-1"], "--draft-model-cost must be a number >= 0"),
])
def test_bad_draft_models_are_one_line_errors(programs, tmp_path, which, flags, message):
    garbage = tmp_path / "garbage.pte"
    garbage.write_bytes(b"not a program" * 100)
    paths = {**{k: str(v) for k, v in programs.items()}, "garbage": str(garbage)}
    flags = [f.format(**paths) for f in flags]
    done = _decode(programs[which], *flags, check=False)
    assert done.returncode == 2, done.stderr
    # One error line of ours (ExecuTorch's loader may log its own reason for a file that is not a program before
    # it; a bad command line is followed by where the usage is).
    errors = [line for line in done.stderr.splitlines() if line.startswith("etmlx_decode: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_cli_generate_and_etmlx_decode_make_the_same_proposals(programs):
    """`etmlx generate --draft-model --draft-model-cost 0` and etmlx_decode with the same flags: the same tokens
    and the same draft counts (one budget and bookkeeping). The flag needs --draft-model, as in etmlx_decode."""
    from helpers import run_cli

    flags = ["--draft-model", str(programs["small"]), "--draft-model-cost", "0"]
    cpp = _decode(programs["spec"], *flags)
    done = run_cli("generate", programs["spec"], "--prompt-ids", ",".join(map(str, PROMPT)), "-m", N, "--json",
                   *flags)
    assert done.returncode == 0, done.stderr
    python = json.loads(done.stdout.strip().splitlines()[-1])
    assert python["tokens"] == cpp["tokens"] and python["draft"] == cpp["draft"]
    assert 0 < cpp["draft"]["accepted"] < cpp["draft"]["proposed"]  # the poor guesser: some drafts rejected
    bad = run_cli("generate", programs["spec"], "--prompt-ids", "5,6", "--draft-model-cost", "0")
    assert bad.returncode == 2 and "--draft-model-cost needs --draft-model" in bad.stderr
    bad = run_cli("generate", programs["plain"], "--prompt-ids", "5,6", "--draft-model-cost", "0")
    assert bad.returncode == 2 and "--draft-model-cost" in bad.stderr and "verifies no drafts" in bad.stderr
