"""A draft model as the draft source (llm/decoder/draft_model.py): its row cache follows the accepted tokens
(after a rejection it proposes what a fresh greedy run on the accepted sequence would), speculative decoding
with it gives the plain program's tokens (greedy and seeded), a draft program with another vocabulary is a
one-line error, and the counts add up (the target's own weights as the draft: every greedy draft accepted)."""

from __future__ import annotations

import json

import pytest

from backends.mlx.llm.decoder.draft_model import DraftModel
from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import eager_greedy, tiny_llama

pytestmark = pytest.mark.slow  # whole decoder exports

VOCAB = 96
K = 4
PROMPT = [5, 17, 3, 40, 8, 5, 17, 3]
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True)
SEEDED = SamplingParams(temperature=0.8, seed=3)


def _llama(seed: int, hidden: int, layers: int, vocab: int = VOCAB):
    return tiny_llama(vocab, seed, head_scale=0.3, hidden=hidden, layers=layers)


@pytest.fixture(scope="module")
def llama():
    return _llama(3, 32, 2)


@pytest.fixture(scope="module")
def programs(tmp_path_factory, llama) -> dict:
    out = tmp_path_factory.mktemp("draft-model")
    paths = {name: out / f"{name}.pte" for name in ("spec", "plain", "pipelined", "proposer", "small", "other-vocab")}
    export_decoder(llama, paths["spec"], 64, config=CONFIG, draft_tokens=K)
    # The target's own weights as plain programs: the reference tokens, and a draft model that is always right.
    export_decoder(llama, paths["plain"], 64, config=CONFIG, pipelined=False)
    export_decoder(llama, paths["pipelined"], 64, config=CONFIG, pipelined=True)
    export_decoder(llama, paths["proposer"], 64, propose_tokens=K)  # K greedy tokens per call (proposer.py)
    export_decoder(_llama(7, 16, 1), paths["small"], 64, config=SamplerConfig(), pipelined=False)  # a poor guesser
    export_decoder(_llama(7, 16, 1, vocab=64), paths["other-vocab"], 64, config=SamplerConfig(), verify=False)
    return paths


def _plain(pte, params, n):
    return [s.token for s in Decoder(pte).stream(PROMPT, n, params, stop_at_eos=False)]


@pytest.mark.parametrize("draft", ["plain", "pipelined", "proposer"])
def test_the_draft_cache_follows_the_accepted_tokens(programs, llama, draft):
    """Proposals after accepted drafts, after a rejection (the output leaves the drafted path: the row's entries
    past the shared prefix are stale) and for a new prompt are the eager model's greedy continuations. (How
    many the budget asks for after a rejection is the budget's business: only their values are checked.)"""
    source = DraftModel(programs[draft], cost=0)  # no timing in the budget

    def check(prompt, output, k=K):
        drafts = source.propose(prompt, output, k)
        assert drafts and drafts == eager_greedy(llama, prompt + output, len(drafts)), (prompt, output)

    truth = eager_greedy(llama, PROMPT, 12)
    assert source.propose(PROMPT, [], K) == truth[:K]  # a fresh budget: all k
    check(PROMPT, truth[:3])  # two drafts accepted, then the correction
    check(PROMPT, truth[:5] + [(truth[5] + 1) % VOCAB])  # a token the draft model did not propose
    check(PROMPT, truth[:5] + [(truth[5] + 1) % VOCAB, 9, 9])
    check([1, 2, 3, 40], [])  # another prompt
    check(PROMPT, truth[:2])  # back to the first, shorter than the row holds
    # Past the end of the draft program's cache it proposes no more than fits (64 positions here).
    fresh = DraftModel(programs[draft], cost=0)
    long = (PROMPT * 8)[:62]
    assert len(fresh.propose(long, [], K)) == 2 and fresh.propose(long + [1, 2], [], K) == []


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_tokens_are_the_plain_programs_with_a_draft_model(programs, params):
    n = 40
    sampling = SamplingParams() if params == "greedy" else SEEDED
    reference = _plain(programs["plain"], sampling, n)
    decoder = SpeculativeDecoder(programs["spec"])
    for draft in ("plain", "pipelined", "proposer", "small"):
        source = DraftModel(programs[draft], target=decoder, cost=0)  # sized as prompt lookup: no timing in it
        tokens = list(decoder.stream(PROMPT, n, sampling, draft=source, stop_at_eos=False))
        assert tokens == reference, f"{params}, draft {draft}"
        stats = decoder.stats
        assert 0 < stats.proposed and stats.accepted <= stats.proposed
        if params == "greedy" and draft != "small":  # the target's own weights: every greedy draft is right
            assert stats.accepted == stats.proposed and stats.calls <= -(-n // (K + 1)) + 1
            # One draft program call per draft; a pipelined program needs one more per proposal; a proposer
            # makes a proposal's drafts in one call.
            proposals = stats.calls if draft == "pipelined" else 0
            if draft == "proposer":
                assert stats.proposed > source.calls and source.calls <= stats.calls
            else:
                assert source.calls == stats.proposed + proposals
    # A draft model whose calls cost five target calls proposes only the budget's rare probes.
    source = DraftModel(programs["plain"], target=decoder, cost=5)
    assert list(decoder.stream(PROMPT, n, sampling, draft=source, stop_at_eos=False)) == reference
    assert decoder.stats.proposed <= n // DraftBudget.PROBE_EVERY + 1


def test_a_draft_model_with_another_vocabulary_is_refused(programs):
    decoder = SpeculativeDecoder(programs["spec"])
    with pytest.raises(ValueError, match=r"vocabulary of 64 tokens but .*spec\.pte has 96"):
        DraftModel(programs["other-vocab"], target=decoder)


def _cli(capsys, *argv):
    from backends.mlx.cli.main import main

    rc = main(["generate", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_cli_generate_with_a_draft_model(programs, capsys):
    ids = ",".join(map(str, PROMPT))
    for seeded in ([], ["--temperature", "0.8", "--seed", "3"]):
        rc, out, _ = _cli(capsys, str(programs["plain"]), "--prompt-ids", ids, "-m", "24", "--json", *seeded)
        plain = json.loads(out.strip().splitlines()[-1])
        for k in ([], ["--num-draft-tokens", "2"]):
            rc, out, _ = _cli(capsys, str(programs["spec"]), "--prompt-ids", ids, "-m", "24", "--json",
                              "--draft-model", str(programs["plain"]), *seeded, *k)
            assert rc == 0
            report = json.loads(out.strip().splitlines()[-1])
            assert report["tokens"] == plain["tokens"], (seeded, k)
            draft = report["draft"]
            # at most a call per token, and one more: a pipelined program's first token comes with its second call
            assert draft["accepted"] <= draft["proposed"] and draft["calls"] <= len(plain["tokens"]) + 1
            if not seeded:  # the same weights: every greedy draft is accepted
                assert 0 < draft["accepted"] == draft["proposed"]


def test_cli_draft_model_errors_are_one_line(programs, capsys):
    spec, ids = str(programs["spec"]), "5,6,7"
    cases = [([spec, "--draft-model", str(programs["other-vocab"])], "vocabulary of 64 tokens"),
             ([spec, "--draft-model", str(programs["plain"]), "--draft", "ngram"], "give --draft or --draft-model"),
             ([str(programs["plain"]), "--draft-model", str(programs["small"])], "--draft-tokens K"),
             ([spec, "--draft-model", str(programs["spec"])], "cannot drive it")]
    for argv, message in cases:
        rc, _, err = _cli(capsys, *argv, "--prompt-ids", ids)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and message in lines[0], (argv, err)


def test_the_builtin_draft_model_drafts_for_the_demo_model(tmp_path_factory):
    """The built-in draft recipe (here, as the demo's, trained 60 steps) has the demo model's tokenizer, and its
    drafts for the demo model are accepted in part while the tokens stay the plain program's."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.builtin.model import (DEFAULT_RECIPE, DRAFT_CHECKPOINT_NAME, DRAFT_RECIPE,
                                                ensure_builtin_checkpoint)
    from backends.mlx.llm.decoder.prompt import encode_prompt
    from run_once import shared_dir

    ckpt = ensure_builtin_checkpoint(shared_dir(tmp_path_factory, "builtin-steps60"),
                                     dataclasses.replace(DEFAULT_RECIPE, steps=60))
    draft_ckpt = ensure_builtin_checkpoint(shared_dir(tmp_path_factory, "builtin-draft-steps60"),
                                           dataclasses.replace(DRAFT_RECIPE, steps=60), name=DRAFT_CHECKPOINT_NAME)
    assert (draft_ckpt / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    out = tmp_path_factory.mktemp("builtin-draft-model")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_ckpt), attn_implementation="eager").eval()
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in model.parameters()) / 1.5
    export_decoder(model, out / "plain.pte", 128, config=CONFIG, tokenizer=ckpt)
    export_decoder(model, out / "spec.pte", 128, config=CONFIG, tokenizer=ckpt, draft_tokens=8)
    export_decoder(draft, out / "draft.pte", 128, config=CONFIG, tokenizer=draft_ckpt, pipelined=False)
    plain = Decoder(out / "plain.pte")
    prompt = encode_prompt(plain.tokenizer, "One morning, Mira went to")
    n = 60
    reference = [s.token for s in plain.stream(prompt, n, stop_at_eos=False)]
    decoder = SpeculativeDecoder(out / "spec.pte")
    tokens = list(decoder.stream(prompt, n, draft=DraftModel(out / "draft.pte", target=decoder, cost=0),
                                 stop_at_eos=False))
    assert tokens == reference
    assert decoder.stats.accepted > decoder.stats.proposed // 4 and decoder.stats.calls < n // 2


def test_the_draft_checkpoint_lives_beside_the_demo_checkpoint(tmp_path):
    import dataclasses

    from backends.mlx.llm.builtin.model import (DRAFT_CHECKPOINT_NAME, STAMP, BuiltinRecipe,
                                                ensure_builtin_checkpoint, read_stamp)

    tiny = BuiltinRecipe(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, steps=2,
                         batch=2, seq_len=32, warmup=1)
    demo = ensure_builtin_checkpoint(tmp_path, tiny)
    built = (demo / STAMP).stat().st_mtime_ns
    draft = ensure_builtin_checkpoint(tmp_path, dataclasses.replace(tiny, hidden_size=8), name=DRAFT_CHECKPOINT_NAME)
    assert read_stamp(draft)["recipe"]["hidden_size"] == 8
    assert ensure_builtin_checkpoint(tmp_path, tiny) == demo and (demo / STAMP).stat().st_mtime_ns == built  # kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [".builtin-llama-draft.lock", ".builtin-llama.lock",
                                                         "builtin-llama", "builtin-llama-draft"]


def test_python_api_with_a_draft_model(programs):
    """etmlx.generate / stream_generate take draft_model= (a path, or a DraftModel that keeps its cache), also
    with a prompt cache over two turns; with another draft option or on a plain program it is a one-line error."""
    import etmlx

    plain, spec = etmlx.load(programs["plain"]), etmlx.load(programs["spec"])
    small = DraftModel(programs["small"], target=spec)
    for sampling in ({}, {"temperature": 0.8, "seed": 3}):
        reference = [r.token for r in etmlx.stream_generate(plain, PROMPT, 24, **sampling)]
        for draft_model in (programs["plain"], small):
            responses = list(etmlx.stream_generate(spec, PROMPT, 24, draft_model=draft_model, **sampling))
            assert [r.token for r in responses] == reference, (sampling, draft_model)
            last = responses[-1]
            assert 0 <= last.accepted_draft_tokens <= last.proposed_draft_tokens
            if draft_model is not small or not sampling:  # a fresh source's first proposal is its whole budget;
                # `small` reused (a poor guesser) may rightly propose nothing in 24 tokens: its budget learned that
                # its drafts fail, and when it probes again depends on measured times
                assert 0 < last.proposed_draft_tokens, (sampling, draft_model)
    turns = [PROMPT, [9, 30, 2]]
    caches = etmlx.make_prompt_cache(plain), etmlx.make_prompt_cache(spec)
    for turn in turns:
        reference = [r.token for r in etmlx.stream_generate(plain, turn, 12, prompt_cache=caches[0])]
        got = [r.token for r in etmlx.stream_generate(spec, turn, 12, prompt_cache=caches[1], draft_model=small)]
        assert got == reference
    with pytest.raises(ValueError, match="give prediction or draft_model, not both"):
        etmlx.generate(spec, PROMPT, 4, prediction=[1, 2], draft_model=small)
    with pytest.raises(ValueError, match="draft_model needs a program exported with --draft-tokens K"):
        etmlx.generate(plain, PROMPT, 4, draft_model=programs["small"])
    with pytest.raises(ValueError, match="vocabulary of 64 tokens"):
        etmlx.generate(spec, PROMPT, 4, draft_model=programs["other-vocab"])
