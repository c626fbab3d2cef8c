"""Draft-verifying programs (`--draft-tokens K`) and the speculative driver: the tokens are plain decoding's
with every draft source (greedy; seeded sampling with filters and penalties too), per-row drafts in a batch
match the eager model, stale KV entries of rejected drafts are never attended (a sliding-window model
included), and the metadata tells loaders the calling convention. Draft programs are pipelined by default
(their calls without drafts need not wait: pipelined_verify.py); the unpipelined ones (--no-pipeline) are
checked beside them."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.decoder.step_inputs import step_inputs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method
from helpers import eager_greedy, tiny_llama

pytestmark = pytest.mark.slow  # whole decoder exports

VOCAB = 96
K = 4
PROMPT = [5, 17, 3, 40, 8, 5, 17, 3]
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=2, penalties=True)
PARAMS = {
    "greedy": SamplingParams(),
    "top_k_top_p": SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9),
    "penalties": SamplingParams(temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                                repetition_penalty=1.2, logit_bias={7: 2.0}),
}


def _llama():
    return tiny_llama(VOCAB, seed=3, head_scale=0.3)


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def programs(tmp_path_factory, llama) -> dict:
    out = tmp_path_factory.mktemp("speculative")
    paths = {"plain": out / "plain.pte", "draft": out / "draft.pte", "unpipelined": out / "unpipelined.pte"}
    export_decoder(llama, paths["plain"], 64, config=CONFIG)
    export_decoder(llama, paths["draft"], 64, config=CONFIG, draft_tokens=K)  # verified on export too
    export_decoder(llama, paths["unpipelined"], 64, config=CONFIG, draft_tokens=K, pipelined=False)
    return paths


def _plain(pte, params, n):
    return [s.token for s in Decoder(pte).stream(PROMPT, n, params, stop_at_eos=False)]


def _sources(reference):
    wrong = list(reference)
    for i in range(3, len(wrong), 7):  # a prediction that is right in runs, wrong every 7th token
        wrong[i] = (wrong[i] + 1) % VOCAB
    return {"none": None, "ngram": NgramDraft(), "prediction": PredictionDraft(reference),
            "edited prediction": PredictionDraft(wrong)}


@pytest.mark.parametrize("program", ["draft", "unpipelined"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_tokens_are_plain_decodings_with_every_draft_source(programs, llama, params, program):
    n = 40
    reference = _plain(programs["plain"], PARAMS[params], n)
    if params == "greedy":
        assert reference == eager_greedy(llama, PROMPT, n)
    decoder = SpeculativeDecoder(programs[program])
    pipelined = program == "draft"
    for name, source in _sources(reference).items():
        tokens = list(decoder.stream(PROMPT, n, PARAMS[params], draft=source, stop_at_eos=False))
        assert tokens == reference, f"{params}, {name} drafts"
        stats = decoder.stats
        if name == "prediction":  # the exact continuation: every draft accepted, K + 1 tokens a call
            assert stats.accepted == stats.proposed > 0 and stats.calls <= -(-n // (K + 1)) + 1
        if name == "edited prediction":
            assert 0 < stats.accepted < stats.proposed
        if name == "none":  # a pipelined program's first token comes with its second call
            assert stats.proposed == 0 and stats.calls == n + pipelined


def test_per_row_drafts_in_a_batch_match_the_eager_model(tmp_path, llama):
    """Three rows at their own positions, each with its own number of drafts (0, 2, 4; right and wrong ones);
    then a call after the rejections, whose queries must not see the rejected drafts' KV entries."""
    pte = tmp_path / "batch.pte"
    export_decoder(llama, pte, 64, config=SamplerConfig(), batch=3, draft_tokens=K, verify=False)
    meta = DecoderMeta.load(pte)
    method = load_method(pte)
    prompts = [PROMPT, PROMPT[:5], [9, 9, 30, 2, 11, 60, 1]]
    seqs = [list(p) + eager_greedy(llama, p, 1) for p in prompts]  # prompt + the first (prefill) token

    def call(rows, starts, drafts_per_row):
        width = max(len(r) for r in rows)
        tokens = torch.zeros(3, width, dtype=torch.int64)
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = torch.tensor(r)
        inputs = step_inputs(meta, tokens, starts, [len(r) for r in rows], [SamplingParams()] * 3, [0] * 3,
                             [True] * 3, drafts=drafts_per_row)
        accepted, token, *_ = method.execute(inputs)  # (and `fed`: a pipelined program, every call delivered)
        return accepted.tolist(), token.tolist()

    accepted, token = call(prompts, [0, 0, 0], [[], [], []])
    assert accepted == [0, 0, 0] and token == [s[-1] for s in seqs]
    for round_ in range(3):
        rows, drafts = [], []
        for b, seq in enumerate(seqs):
            truth = eager_greedy(llama, seq, 4)
            d = [0, 2, 4][(b + round_) % 3]
            guess = truth[:d]
            if b == round_ and d:  # one wrong draft per round: its KV entry goes stale
                guess[d // 2] = (guess[d // 2] + 1) % VOCAB
            rows.append([seq[-1]] + guess)
            drafts.append(guess)
        accepted, token = call(rows, [len(s) - 1 for s in seqs], drafts)
        for b, seq in enumerate(seqs):
            guess, truth = rows[b][1:], eager_greedy(llama, seq, 5)
            n = next((i for i, (g, t) in enumerate(zip(guess, truth)) if g != t), len(guess))
            assert (accepted[b], token[b]) == (n, truth[n]), f"round {round_}, row {b}"
            seq.extend(truth[:n + 1])


def test_sliding_window_model_keeps_full_caches(tmp_path):
    """A model whose window is narrower than the cache: rejected drafts must not clobber a ring slot."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=6, eos_token_id=None,
                                             bos_token_id=None)).eval()
    pte = tmp_path / "window.pte"
    export_decoder(model, pte, 48, config=SamplerConfig(), draft_tokens=K)
    reference = eager_greedy(model, PROMPT, 30)
    wrong = [(t + 1) % VOCAB if i % 3 == 2 else t for i, t in enumerate(reference)]  # a rejection every call
    decoder = SpeculativeDecoder(pte)
    tokens = list(decoder.stream(PROMPT, 30, draft=PredictionDraft(wrong), stop_at_eos=False))
    assert tokens == reference
    assert 0 < decoder.stats.accepted < decoder.stats.proposed


def test_a_call_without_drafts_carries_one_column(programs, llama):
    """A one-row program's call without drafts sends only the last token (G = 1: the head and sampler of a
    plain step), and answers as a call padded to 2 columns does (how programs exported before
    verify_min_width were called)."""
    meta = DecoderMeta.load(programs["unpipelined"])
    assert meta.verify_min_width == 1
    method = load_method(programs["unpipelined"])
    seq = list(PROMPT) + eager_greedy(llama, PROMPT, 3)
    answers = {}
    for min_width in (1, 2):
        meta.verify_min_width = min_width
        for pos in range(len(PROMPT), len(seq)):  # one decode call per token, no drafts
            tokens = torch.tensor([seq[:pos] if pos == len(PROMPT) else [seq[pos - 1]]])
            inputs = step_inputs(meta, tokens, [0 if pos == len(PROMPT) else pos - 1], [tokens.shape[1]],
                                 [SamplingParams()], [0], [pos == len(PROMPT)], drafts=[[]])
            assert inputs[3].shape == (1, min_width)
            accepted, token = method.execute(inputs)
            answers.setdefault(min_width, []).append((int(accepted), int(token)))
    assert answers[1] == answers[2] == [(0, t) for t in seq[len(PROMPT):]]


def test_generate_measures_from_the_first_call_that_accepted_drafts(programs):
    """The decode rate counts from when the first call returned, even when that call (the prefill) accepted
    drafts and so delivered several tokens at once (it once kept a zero start time then: a rate near 0)."""
    reference = _plain(programs["plain"], SamplingParams(), 20)
    spec = SpeculativeDecoder(programs["draft"])
    before = time.perf_counter()
    tokens, rate = spec.generate(PROMPT, 20, draft=PredictionDraft(reference), stop_at_eos=False)
    after = time.perf_counter()
    first_time, first_tokens = spec.first_call
    assert tokens == reference
    assert before < first_time < after and first_tokens == 1 + K  # the prefill accepted all K drafts
    assert rate >= (len(tokens) - first_tokens) / (after - first_time)


def test_metadata_and_loaders(programs):
    assert DecoderMeta.load(programs["draft"]).draft_tokens == K
    assert DecoderMeta.load(programs["plain"]).draft_tokens == 0
    meta = DecoderMeta.load(programs["draft"])
    assert meta.pipelined and meta.inputs[:5] == ["tokens", "start_pos", "lengths", "verify", "deliver"]
    assert meta.outputs == ["accepted", "token", "fed"]
    meta = DecoderMeta.load(programs["unpipelined"])
    assert not meta.pipelined and meta.inputs[:5] == ["tokens", "start_pos", "lengths", "verify", "temperature"]
    assert meta.outputs == ["accepted", "token"]
    with pytest.raises(ValueError, match="exported with --draft-tokens 4.*cannot drive it"):
        Decoder(programs["draft"])
    with pytest.raises(ValueError, match="does not verify drafts"):
        SpeculativeDecoder(programs["plain"])


def test_export_refuses_what_a_verifying_program_cannot_do(tmp_path, llama):
    with pytest.raises(ValueError, match="cannot take a mask"):
        export_decoder(llama, tmp_path / "x.pte", 32, config=SamplerConfig(allowed_mask=True), draft_tokens=2,
                       pipelined=True)
    with pytest.raises(ValueError, match="logprobs"):
        export_decoder(llama, tmp_path / "x.pte", 32, config=SamplerConfig(logprobs=2), draft_tokens=2)
    with pytest.raises(ValueError, match="below max_seq_len"):
        export_decoder(llama, tmp_path / "x.pte", 8, draft_tokens=8)
    with pytest.raises(ValueError, match="draft_tokens must be an int >= 0"):
        export_decoder(llama, tmp_path / "x.pte", 32, draft_tokens=-1)
    assert not (tmp_path / "x.pte").exists()


def test_builtin_model_greedy_tokens_with_every_draft_source(tmp_path_factory):
    """The built-in demo model (the suite's shorter recipe, shared with test_builtin_model.py), on a demo
    prompt: greedy speculative decoding gives the plain program's tokens, which are transformers' greedy ones."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.builtin.model import DEFAULT_RECIPE, ensure_builtin_checkpoint
    from backends.mlx.llm.decoder.prompt import encode_prompt
    from run_once import shared_dir

    ckpt = ensure_builtin_checkpoint(shared_dir(tmp_path_factory, "builtin-steps60"),
                                     dataclasses.replace(DEFAULT_RECIPE, steps=60))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    out = tmp_path_factory.mktemp("builtin-speculative")
    config = SamplerConfig(top_k=True, top_p=True, min_p=True)
    export_decoder(model, out / "plain.pte", 128, config=config, tokenizer=ckpt)
    export_decoder(model, out / "draft.pte", 128, config=config, tokenizer=ckpt, draft_tokens=8)
    plain = Decoder(out / "plain.pte")
    prompt = encode_prompt(plain.tokenizer, "One morning, Mira went to")
    n = 60
    reference = [s.token for s in plain.stream(prompt, n, stop_at_eos=False)]
    assert reference == eager_greedy(model, prompt, n)
    decoder = SpeculativeDecoder(out / "draft.pte")
    edited = [(t + 1) % model.config.vocab_size if i % 10 == 9 else t for i, t in enumerate(reference)]
    for name, source in {"none": None, "ngram": NgramDraft(), "prediction": PredictionDraft(reference),
                         "edited prediction": PredictionDraft(edited)}.items():
        tokens = list(decoder.stream(prompt, n, draft=source, stop_at_eos=False))
        assert tokens == reference, name
        if source is not None:
            assert decoder.stats.accepted > 0, name


def _cli_json(capsys, *argv) -> dict:
    import json

    from backends.mlx.cli.main import main

    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_generate_on_a_draft_program_gives_the_plain_tokens(programs, capsys, tmp_path):
    """`etmlx generate` decodes a --draft-tokens program speculatively: every draft source (prompt lookup by
    default, a predicted output, none) gives the plain program's tokens, greedy and seeded; --json reports the
    drafts, and an exact prediction is accepted in full."""
    ids = ",".join(map(str, PROMPT))
    for seeded in ([], ["--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9"]):
        plain = _cli_json(capsys, str(programs["plain"]), "--prompt-ids", ids, "-m", "24", *seeded)
        assert "draft" not in plain
        prediction = ",".join(map(str, plain["tokens"]))
        (tmp_path / "prediction.txt").write_text(prediction + "\n")
        for flags in ([], ["--draft", "none"], ["--prediction", prediction], ["--num-draft-tokens", "2"],
                      ["--prediction", f"@{tmp_path / 'prediction.txt'}"]):  # ids from a file too
            out = _cli_json(capsys, str(programs["draft"]), "--prompt-ids", ids, "-m", "24", *seeded, *flags)
            assert out["tokens"] == plain["tokens"], flags
            assert out["draft"]["accepted"] <= out["draft"]["proposed"]
            if flags and flags[0] == "--prediction":
                assert out["draft"]["accepted"] == out["draft"]["proposed"] >= len(plain["tokens"]) - 5
                assert out["draft"]["calls"] <= len(plain["tokens"]) // K + 2
            if flags == ["--draft", "none"]:
                assert out["draft"]["proposed"] == 0


def test_cli_draft_flags_on_a_plain_program_are_one_line_errors(programs, capsys):
    from backends.mlx.cli.main import main

    assert main(["generate", str(programs["plain"]), "--prompt-ids", "5,6", "--prediction", "7,8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-tokens" in err[0], err
    assert main(["generate", str(programs["draft"]), "--prompt-ids", "5,6", "--num-draft-tokens", str(K + 1)]) == 2
    assert "--num-draft-tokens must be 0..4" in capsys.readouterr().err
