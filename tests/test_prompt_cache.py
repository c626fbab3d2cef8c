"""The prompt cache (runtime/decode_rows.h): a row's KV cache outlives its request, and a prompt that
extends what a row holds prefills only the rest. Reuse must not change a token: greedy ids are the eager
model's (full forward passes, no cache), seeded sampling with penalties equals a fresh program's, on
pipelined and unpipelined programs, with other rows idling in between; the server reports
usage.prompt_tokens_details.cached_tokens and evicts the least recently used row."""

from __future__ import annotations

import openai
import pytest
import torch

import etmlx
from backends.mlx.llm.builtin.tiny_model import train_tokenizer, tiny_llama
from backends.mlx.llm.decoder.decode_rows import DecodeRows, Sequence
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.app import ServerThread
from backends.mlx.serve.engine import Engine, EngineRequest
from serve_helpers import bit_exact_batching, eager_greedy, eager_model, tiny_pte

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]
MORE = [33, 8, 91, 14]
CONFIG = SamplerConfig(top_k=True, penalties=True, logit_bias=2)


@pytest.fixture(scope="module")
def eager():
    return eager_model()


@pytest.fixture(scope="module")
def programs(tmp_path_factory, eager):
    """The tiny model, batch 2 (a second row idles), pipelined and not."""
    model, tokenizer = eager
    out = tmp_path_factory.mktemp("prompt_cache")
    paths = {}
    for pipelined in (False, True):
        paths[pipelined] = out / f"tiny-{pipelined}.pte"
        export_decoder(model, paths[pipelined], 64, config=CONFIG, batch=2, tokenizer=tokenizer, pipelined=pipelined,
                       verify=False)
    return paths


def _no_eos(decoder, **params):
    return SamplingParams(logit_bias={decoder.meta.eos_token_ids[0]: -100}, **params)


def _tokens(decoder, prompt, n, params, reuse):
    return [s.token for s in decoder.stream(prompt, n, params, reuse=reuse)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_reuse_gives_the_eager_tokens(programs, eager, pipelined):
    decoder = Decoder(programs[pipelined])
    params = _no_eos(decoder)
    first = _tokens(decoder, PROMPT, 8, params, reuse=True)
    assert decoder.last_cached == 0
    second_prompt = PROMPT + first + MORE
    second = _tokens(decoder, second_prompt, 8, params, reuse=True)
    # unpipelined: the last token was sampled, never fed; pipelined: fed back to the device too
    assert decoder.last_cached == len(PROMPT) + len(first) - (0 if pipelined else 1)
    expected = [t for t, _ in eager_greedy(eager[0], second_prompt, 8, banned=decoder.meta.eos_token_ids[0])]
    assert second == expected
    assert _tokens(Decoder(programs[pipelined]), second_prompt, 8, params, reuse=False) == expected


@pytest.mark.parametrize("pipelined", [False, True])
def test_seeded_sampling_with_penalties_is_unchanged_by_reuse(programs, pipelined):
    decoder = Decoder(programs[pipelined])
    params = _no_eos(decoder, temperature=1.0, seed=11, top_k=40, repetition_penalty=1.3, presence_penalty=0.7)
    first = _tokens(decoder, PROMPT, 6, params, reuse=True)
    prompt = PROMPT + first + MORE
    reused = _tokens(decoder, prompt, 12, params, reuse=True)
    assert decoder.last_cached > len(PROMPT)
    fresh = _tokens(Decoder(programs[pipelined]), prompt, 12, params, reuse=False)
    assert reused == fresh
    other_seed = _tokens(Decoder(programs[pipelined]), prompt, 12, _no_eos(decoder, temperature=1.0, seed=12,
                                                                              top_k=40), reuse=False)
    assert other_seed != fresh  # the comparison can tell samples apart


def test_an_idle_row_keeps_its_cache_and_the_least_recently_used_row_is_taken(programs, eager):
    decoder = Decoder(programs[False])
    params = _no_eos(decoder)
    a = _tokens(decoder, PROMPT, 5, params, reuse=True)
    other = [200, 1, 2, 3, 4, 5]
    _tokens(decoder, other, 5, params, reuse=True)  # takes the empty row: row 0 idles through it
    assert [r.used for r in decoder.rows.caches.rows] == [1, 2]
    prompt = PROMPT + a + MORE
    got = _tokens(decoder, prompt, 6, params, reuse=True)
    assert decoder.last_cached == len(PROMPT) + len(a) - 1
    assert got == [t for t, _ in eager_greedy(eager[0], prompt, 6, banned=decoder.meta.eos_token_ids[0])]
    _tokens(decoder, [300, 301, 302], 3, params, reuse=True)  # evicts the least recently used: `other`'s row
    assert decoder.rows.caches.rows[0].tokens[:len(PROMPT)] == PROMPT
    assert decoder.rows.caches.rows[1].tokens[:3] == [300, 301, 302]


def test_prompt_cache_api_appends_turns(programs):
    model = etmlx.load(programs[True])
    cache = etmlx.make_prompt_cache(model)
    first = [r.token for r in etmlx.stream_generate(model, PROMPT, 6, prompt_cache=cache)]
    assert cache.tokens == PROMPT + first
    responses = list(etmlx.stream_generate(model, MORE, 6, prompt_cache=cache))
    assert responses[-1].cached_tokens == len(PROMPT) + len(first)
    assert responses[-1].prompt_tokens == len(PROMPT) + len(first) + len(MORE)
    fresh = [r.token for r in etmlx.stream_generate(etmlx.load(programs[True]), PROMPT + first + MORE, 6)]
    assert [r.token for r in responses] == fresh
    with pytest.raises(TypeError, match="make_prompt_cache"):
        etmlx.generate(model, MORE, 2, prompt_cache=etmlx.make_prompt_cache(etmlx.load(programs[True])))


class _EagerProgram:
    """A decoder program run eagerly (no export): the head over StaticCacheLM, inputs in the meta's order."""

    def __init__(self, head, meta):
        self.head, self.meta = head, meta

    @torch.no_grad()
    def execute(self, inputs):
        named = dict(zip(self.meta.inputs, inputs))
        out = self.head(named["tokens"], named["start_pos"], named["lengths"], temperature=named["temperature"],
                        seed=named["seed"])
        return [out]


def _ring_model():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=5, attn_implementation="eager")
    return MistralForCausalLM(config).eval()


def test_a_ring_cache_is_reused_only_where_positions_continue():
    model = _ring_model()
    lm = StaticCacheLM(model, max_seq_len=40, batch=2)
    assert lm.ring_window(0) == 5
    meta = DecoderMeta.build(max_seq_len=40, vocab_size=96, batch=2, eos_token_ids=[], seeded=True,
                             config=SamplerConfig(), dtype="float32", ring_cache=True)
    program = _EagerProgram(SamplingHead(lm, SamplerConfig()), meta)
    rows = DecodeRows(meta)

    def run(prompt, n):
        slot, _ = rows.choose(prompt, 2)
        row = rows.start(slot, Sequence(prompt, SamplingParams(), n, stop_at_eos=False))
        out = []
        while rows.rows[slot] is row:
            out += [e.token for _, _, e in rows.read(program.execute(rows.call_inputs()))]
        return out, row.cached

    prompt = [int(t) for t in torch.randint(0, 96, (9,))]
    first, _ = run(prompt, 6)
    run([1, 2, 3], 4)  # another row, while the first idles (twice as wide at its prefill)
    extended = prompt + first + [7, 8]
    got, cached = run(extended, 6)
    assert cached == len(prompt) + len(first) - 1  # positions continue: reused
    assert got == [t for t, _ in eager_greedy(model, extended, 6)]
    diverged = prompt[:4] + [50, 51, 52]  # shares 4 tokens, but the row's ring holds later positions
    got, cached = run(diverged, 5)
    assert cached == 0
    assert got == [t for t, _ in eager_greedy(model, diverged, 5)]


# ---- the server ----

class _Echo:
    """A stand-in program: every row samples token 1 (never eos); records each call's start positions."""

    def __init__(self, meta):
        self.meta, self.starts = meta, []

    def execute(self, inputs):
        named = dict(zip(self.meta.inputs, inputs))
        self.starts.append(named["start_pos"].tolist())
        batch = self.meta.batch
        return [torch.ones(batch, dtype=torch.int64)]


def test_the_server_engine_evicts_the_least_recently_used_row():
    meta = DecoderMeta.build(max_seq_len=32, vocab_size=50, batch=2, eos_token_ids=[0], seeded=True,
                             config=SamplerConfig(), dtype="float32", ring_cache=False)
    engine = Engine(_Echo(meta), meta)
    engine.running = True

    def finish(prompt):
        request = EngineRequest(prompt, SamplingParams(), 3, lambda event: None)
        engine.submit(request)
        while True:
            assert engine._drain()
            engine._admit()
            if not engine.active_rows:
                return request.cached_tokens
            engine._step()

    a, b, c = [2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13]
    assert finish(a) == 0 and finish(b) == 0
    assert finish(a + [1, 1, 20]) == len(a) + 2  # a's row holds a + two of its three sampled tokens
    assert finish(c) == 0  # takes b's row: the least recently used
    assert finish(a + [1, 1, 20, 1, 1, 22]) == len(a) + 5  # a's row kept what the last request wrote
    assert finish(b + [21]) == 0  # b is gone


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with bit_exact_batching():
        srv = ServerThread(tiny_pte(tmp_path_factory), model_name="tiny").start()
    yield srv
    srv.stop()


def test_server_reports_cached_tokens_and_gives_the_eager_tokens(server, eager):
    model, tokenizer = eager
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    eos = server.service.meta.eos_token_ids[0]
    bias = {str(eos): -100}
    prompt = tokenizer.encode("Mira went to the market and", add_special_tokens=False)
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias,
                                    logprobs=1)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    first = [t for t, _ in eager_greedy(model, prompt, 6, banned=eos)]  # what `one` decoded (test_serve_openai)
    turn2 = prompt + first + tokenizer.encode(" then", add_special_tokens=False)
    two = client.completions.create(model="tiny", prompt=turn2, max_tokens=6, temperature=0, logit_bias=bias,
                                    logprobs=1)
    assert two.usage.prompt_tokens_details.cached_tokens >= len(prompt)
    expected = eager_greedy(model, turn2, 6, banned=eos)
    assert two.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t, _ in expected]
    chat = [{"role": "user", "content": "Hi"}]  # the template's frame makes ~50 tokens of two short turns
    reply = client.chat.completions.create(model="tiny", messages=chat, max_tokens=3, temperature=0)
    chat += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Ok"}]
    again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("affinity", [True, False])
def test_requests_sharing_a_long_prefix_wait_for_the_row_that_holds_it(affinity):
    meta = DecoderMeta.build(max_seq_len=256, vocab_size=50, batch=2, eos_token_ids=[0], seeded=True,
                             config=SamplerConfig(), dtype="float32", ring_cache=False)
    program = _Echo(meta)
    engine = Engine(program, meta, prefix_affinity=affinity)
    engine.running = True
    prefix = [2 + i % 40 for i in range(200)]
    requests = [EngineRequest(prefix + [40 + i], SamplingParams(), 3, lambda event: None) for i in range(3)]
    engine.submit_all(requests)
    while True:
        assert engine._drain()
        engine._admit()
        if not engine.active_rows and not engine.waiting:
            break
        engine._step()
    if affinity:  # one prefill of the prefix; the others wait 3 steps each for its row
        assert [r.cached_tokens for r in requests] == [0, 200, 200]
    else:  # both rows prefill it at once; the third reuses whichever row frees first
        assert [r.cached_tokens for r in requests] == [0, 0, 200]


def test_a_decoder_runs_one_generation_at_a_time(programs):
    decoder = Decoder(programs[False])
    first = decoder.stream(PROMPT, 3, _no_eos(decoder))
    next(first)
    with pytest.raises(RuntimeError, match="unfinished"):
        next(decoder.stream(PROMPT, 3))
    first.close()  # frees its row; what it wrote stays reusable
    assert len(_tokens(decoder, PROMPT + [1], 3, _no_eos(decoder), reuse=True)) == 3
    assert decoder.last_cached == len(PROMPT)
