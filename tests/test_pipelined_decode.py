"""Pipelined decoder programs (llm/decoder/pipelined.py): each call returns the previous call's outputs
and -1 feeds the device's own last token. Through the Python Decoder they give exactly the tokens and
logprobs of the same model exported unpipelined, and the raw protocol does what the docstring says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import FED_BACK, DecoderMeta
from backends.mlx.llm.decoder.step_inputs import step_inputs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method
from helpers import tiny_llama

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

VOCAB = 96
PROMPT = [5, 17, 3, 40, 8]
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True, penalties=True, logprobs=3)
PARAMS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "top_k_top_p": SamplingParams(temperature=1.3, seed=2, top_k=12, top_p=0.9),
    "penalties": SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.5, frequency_penalty=0.5),
}


def _model(eos=None):
    return tiny_llama(VOCAB, seed=3, head_scale=0.1, max_positions=64, eos=eos)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[bool, Path]:
    out = tmp_path_factory.mktemp("pipelined")
    model = _model()
    paths = {}
    for pipelined in (False, True):
        paths[pipelined] = out / f"p{int(pipelined)}.pte"
        export_decoder(model, paths[pipelined], 48, config=CONFIG, pipelined=pipelined)
    return paths


def _stream(pte, params, n, stop_at_eos=True):
    return [(s.token, s.logprob, s.top) for s in Decoder(pte).stream(PROMPT, n, params, stop_at_eos=stop_at_eos)]


def test_metadata_says_which(programs):
    assert DecoderMeta.load(programs[True]).pipelined is True
    assert DecoderMeta.load(programs[False]).pipelined is False


@pytest.mark.parametrize("name", list(PARAMS))
def test_same_tokens_and_logprobs_as_unpipelined(programs, name):
    plain = _stream(programs[False], PARAMS[name], 20, stop_at_eos=False)
    assert len(plain) == 20
    assert _stream(programs[True], PARAMS[name], 20, stop_at_eos=False) == plain


def test_sampled_runs_differ_from_greedy(programs):
    # Otherwise the parity above would not cover the sampling paths.
    greedy = [t for t, _, _ in _stream(programs[False], PARAMS["greedy"], 20, stop_at_eos=False)]
    for name in ("seeded", "top_k_top_p", "penalties"):
        assert [t for t, _, _ in _stream(programs[False], PARAMS[name], 20, stop_at_eos=False)] != greedy, name


def test_one_token_and_repeated_generations(programs):
    decoder = Decoder(programs[True])
    first = decoder.generate(PROMPT, 1, PARAMS["seeded"]).tokens
    assert first == Decoder(programs[False]).generate(PROMPT, 1, PARAMS["seeded"]).tokens
    # A new sequence on the same program starts from its prompt, not from the last one's device token.
    again = [decoder.generate(PROMPT, 6, PARAMS["top_k_top_p"]).tokens for _ in range(2)]
    assert again[0] == again[1] == Decoder(programs[False]).generate(PROMPT, 6, PARAMS["top_k_top_p"]).tokens


def test_stops_at_eos_like_unpipelined(tmp_path):
    plain_path = tmp_path / "plain.pte"
    export_decoder(_model(), plain_path, 48, pipelined=False)
    greedy = Decoder(plain_path).generate(PROMPT, 12).tokens
    eos = greedy[3]  # a token the greedy run produces: as EOS it ends the run there
    model = _model(eos=eos)
    paths = {p: tmp_path / f"eos{int(p)}.pte" for p in (False, True)}
    for pipelined, path in paths.items():
        export_decoder(model, path, 48, pipelined=pipelined)
    runs = {p: Decoder(path).generate(PROMPT, 12) for p, path in paths.items()}
    assert runs[True].tokens == runs[False].tokens == greedy[:greedy.index(eos) + 1]
    assert runs[True].finish_reason == runs[False].finish_reason == "stop"


def test_mask_programs_are_unpipelined_unless_asked(tmp_path):
    mask = SamplerConfig(allowed_mask=True)
    default, forced = tmp_path / "mask.pte", tmp_path / "mask_pipelined.pte"
    export_decoder(_model(), default, 32, config=mask)
    export_decoder(_model(), forced, 32, config=mask, pipelined=True)
    assert DecoderMeta.load(default).pipelined is False
    # Each step's mask depends on the token before it, which a pipelined call returns too late.
    with pytest.raises(ConstraintError, match="unpipelined"):
        list(Decoder(forced).stream(PROMPT, 4, constraint=Constraint("json_object")))


def test_raw_protocol_returns_the_previous_call_and_feeds_back(programs):
    """Call k returns call k-1's token; -1 feeds the device's token, so feeding it explicitly is the same."""
    meta = DecoderMeta.load(programs[True])
    method = load_method(programs[True])
    params = [PARAMS["greedy"]]

    def call(tokens, pos, step):
        inputs = step_inputs(meta, torch.tensor([tokens]), [pos], [len(tokens)], params, [params[0].seed + step],
                             [step == 0])
        return int(method.execute(inputs)[0][0])

    expected = Decoder(programs[False]).generate(PROMPT, 3).tokens
    call(PROMPT, 0, 0)
    t0 = call([FED_BACK], len(PROMPT), 1)
    assert t0 == expected[0]
    # Token 1 given explicitly instead of fed back (the device sampled the same one): same continuation.
    assert call([expected[1]], len(PROMPT) + 1, 2) == expected[1]
    assert call([FED_BACK], len(PROMPT) + 2, 3) == expected[2]


def test_caller_may_reuse_input_memory_at_once(programs):
    """The step goes on running after execute returns: the runtime copied the inputs, so overwriting the
    caller's tensors right away changes nothing."""
    meta = DecoderMeta.load(programs[True])
    method = load_method(programs[True])
    params = [PARAMS["top_k_top_p"]]
    tokens = []
    for step in range(12):
        feed = PROMPT if step == 0 else [FED_BACK]
        pos = 0 if step == 0 else len(PROMPT) + step - 1
        inputs = step_inputs(meta, torch.tensor([feed]), [pos], [len(feed)], params, [params[0].seed + step],
                             [step == 0])
        out = method.execute(inputs)
        for t in inputs:  # garbage where the call's inputs were
            t.fill_(7 if t.dtype != torch.float32 else float("nan"))
        if step:
            tokens.append(int(out[0][0]))
    assert tokens == Decoder(programs[False]).generate(PROMPT, 11, PARAMS["top_k_top_p"]).tokens


class _FmodGate(torch.nn.Module):
    """An MLP activation with no etmlx handler: ExecuTorch's CPU kernel runs it between delegate calls."""

    def forward(self, x):
        return torch.nn.functional.silu(x) + 0.1 * torch.fmod(x, 5.0)


def test_op_outside_the_delegate_decodes_like_unpipelined_and_eager(tmp_path):
    """The fed-back token is state the first delegate call reads and the last one updates; before the
    partitioner kept such state with ExecuTorch, the first call read a stale copy from the second token on."""
    model = _model()
    for layer in model.model.layers:
        layer.mlp.act_fn = _FmodGate()
    ids = list(PROMPT)
    with torch.no_grad():  # eager greedy, the whole sequence recomputed each step
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    eager = ids[len(PROMPT):]
    paths = {p: tmp_path / f"fmod{int(p)}.pte" for p in (False, True)}
    for pipelined, path in paths.items():
        result = export_decoder(model, path, 48, config=CONFIG, pipelined=pipelined)
        assert "aten.fmod.Scalar" in result.outside, result.summary()
        assert result.delegated_calls > 1
    assert Decoder(paths[True]).generate(PROMPT, 10).tokens == Decoder(paths[False]).generate(PROMPT, 10).tokens == eager
    assert len(set(eager)) > 3  # a varied run: a stale fed-back token shows
    for name in ("seeded", "penalties"):
        assert _stream(paths[True], PARAMS[name], 12, False) == _stream(paths[False], PARAMS[name], 12, False), name
