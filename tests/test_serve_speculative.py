"""`etmlx serve` on a draft-verifying program (`--draft-tokens K`): every request decodes speculatively, with
OpenAI's `prediction` as its drafts (Predicted Outputs) or prompt lookup without one, and returns the plain
program's tokens (greedy and seeded); usage reports accepted / rejected prediction tokens as the
SpeculativeDecoder counts them; concurrent requests draft per row; a client leaving mid-stream harms no one;
bad `prediction` shapes and structured output are one-line 400s. A plain program serves `prediction` without
drafts (counts 0), as OpenAI accepts the field."""

from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder import prompt as prompt_rules
from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.app import ServerThread
from serve_helpers import bit_exact_batching, lmtp_exchange

pytestmark = [pytest.mark.server, pytest.mark.slow]  # servers on threads, two decoder exports

K = 4
BATCH = 2
MAX_SEQ_LEN = 96
TOKENS = 24
CONFIG = SamplerConfig(top_k=True, top_p=True, logit_bias=4, penalties=True)
PROMPTS = ["Once upon a time", "Hello there! How are"]
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 3, "top_p": 0.9}}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def programs(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("serve_speculative")
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # flat enough that seeded runs differ from greedy
    paths = {"plain": out / "plain.pte", "draft": out / "draft.pte"}
    export_decoder(model, paths["plain"], MAX_SEQ_LEN, config=CONFIG, tokenizer=tokenizer)
    export_decoder(model, paths["draft"], MAX_SEQ_LEN, config=CONFIG, batch=BATCH, tokenizer=tokenizer,
                   draft_tokens=K)
    return paths


@pytest.fixture(scope="module")
def server(programs):
    with bit_exact_batching():
        srv = ServerThread(programs["draft"], model_name="draft").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(programs):
    with bit_exact_batching():
        srv = ServerThread(programs["plain"], model_name="plain").start()
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _no_eos(tokenizer):
    return {str(tokenizer.eos_token_id): -100}


def _params(tokenizer, sampling: str) -> SamplingParams:
    return SamplingParams(**SAMPLING[sampling], logit_bias={tokenizer.eos_token_id: -100.0})


def _plain_tokens(programs, prompt_ids, params, n=TOKENS) -> list[int]:
    with bit_exact_batching():
        return [s.token for s in Decoder(programs["plain"]).stream(prompt_ids, n, params)]


def _speculative_stats(programs, prompt_ids, params, draft, n=TOKENS):
    """(tokens, proposed, accepted) of the SpeculativeDecoder on the draft program, for the same request."""
    with bit_exact_batching():
        decoder = SpeculativeDecoder(programs["draft"])
        tokens = list(decoder.stream(prompt_ids, n, params, draft=draft))
    return tokens, decoder.stats.proposed, decoder.stats.accepted


def _wrong(text: str) -> str:
    """A prediction that is right in runs and wrong in places (an edit every few characters)."""
    return "".join("#" if i % 9 == 4 else c for i, c in enumerate(text))


def _counts(usage):
    details = usage.completion_tokens_details
    return None if details is None else (details.accepted_prediction_tokens, details.rejected_prediction_tokens)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("source", ["matching", "wrong", "none"])
def test_completion_tokens_are_the_plain_programs(server, programs, tokenizer, sampling, source):
    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[0])
    params = _params(tokenizer, sampling)
    plain = _plain_tokens(programs, prompt_ids, params)
    plain_text = tokenizer.decode(plain)
    predicted = {"matching": plain_text, "wrong": _wrong(plain_text), "none": None}[source]
    extra = {} if predicted is None else {"prediction": {"type": "content", "content": predicted}}
    r = _client(server).completions.create(model="draft", prompt=PROMPTS[0], max_tokens=TOKENS,
                                           logit_bias=_no_eos(tokenizer), **SAMPLING[sampling], extra_body=extra)
    assert r.choices[0].text == plain_text
    assert r.usage.completion_tokens == len(plain) == TOKENS
    draft = (NgramDraft() if predicted is None
             else PredictionDraft(tokenizer.encode(predicted, add_special_tokens=False)))
    tokens, proposed, accepted = _speculative_stats(programs, prompt_ids, params, draft)
    assert tokens == plain
    if predicted is None:
        assert _counts(r.usage) is None  # no prediction: no prediction counts
        return
    assert _counts(r.usage) == (accepted, proposed - accepted)
    if source == "matching":
        assert accepted > 0, (accepted, proposed)  # the text re-tokenizes its own way: not every token
    else:
        assert proposed - accepted > 0


def test_chat_prediction_as_text_parts(server, programs, tokenizer):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    prompt_ids = prompt_rules.chat_prompt(tokenizer, messages)
    params = _params(tokenizer, "seeded")
    plain_text = tokenizer.decode(_plain_tokens(programs, prompt_ids, params))
    half = len(plain_text) // 2
    parts = [{"type": "text", "text": plain_text[:half]}, {"type": "text", "text": plain_text[half:]}]
    r = _client(server).chat.completions.create(
        model="draft", messages=messages, max_tokens=TOKENS, logit_bias=_no_eos(tokenizer), **SAMPLING["seeded"],
        extra_body={"prediction": {"type": "content", "content": parts}})
    assert r.choices[0].message.content == plain_text
    accepted, rejected = _counts(r.usage)
    assert accepted > 0 and accepted + rejected > 0


def test_concurrent_requests_draft_per_row(server, programs, tokenizer):
    """More requests than rows, each with its own prediction (or none): each gets its own plain tokens and
    the counts its request gets alone."""
    cases = []
    for prompt in PROMPTS:
        for sampling in SAMPLING:
            ids = prompt_rules.encode_prompt(tokenizer, prompt)
            text = tokenizer.decode(_plain_tokens(programs, ids, _params(tokenizer, sampling)))
            cases.append((prompt, ids, sampling, text, text if len(cases) % 3 == 0 else _wrong(text)))
    cases.append((PROMPTS[1], prompt_rules.encode_prompt(tokenizer, PROMPTS[1]), "greedy", cases[2][3], None))

    def run(case):
        prompt, _, sampling, _, predicted = case
        extra = {} if predicted is None else {"prediction": {"type": "content", "content": predicted}}
        return _client(server).completions.create(model="draft", prompt=prompt, max_tokens=TOKENS,
                                                   logit_bias=_no_eos(tokenizer), **SAMPLING[sampling],
                                                   extra_body=extra)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (prompt, ids, sampling, text, predicted), r in zip(cases, results):
        assert r.choices[0].text == text, (prompt, sampling, predicted)
        if predicted is not None:
            draft = PredictionDraft(tokenizer.encode(predicted, add_special_tokens=False))
            _, proposed, accepted = _speculative_stats(programs, ids, _params(tokenizer, sampling), draft)
            assert _counts(r.usage) == (accepted, proposed - accepted), (prompt, sampling)


def _open_stream(srv, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_a_client_leaving_mid_stream_harms_no_one(server, programs, tokenizer):
    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[0])
    params = _params(tokenizer, "seeded")
    plain_text = tokenizer.decode(_plain_tokens(programs, prompt_ids, params))
    socks = []
    for _ in range(3):
        sock = _open_stream(server, {"prompt": PROMPTS[0], "max_tokens": 60, "stream": True, "temperature": 0.8,
                                     "seed": 9, "logit_bias": _no_eos(tokenizer),
                                     "prediction": {"type": "content", "content": plain_text}})
        data = b""
        while data.count(b"data: ") < 2:  # verification calls have begun; leave mid-stream
            part = sock.recv(4096)
            assert part, data
            data += part
        socks.append(sock)
    for sock in socks:
        sock.close()
    chunks = list(_client(server).completions.create(
        model="draft", prompt=PROMPTS[0], max_tokens=TOKENS, logit_bias=_no_eos(tokenizer), stream=True,
        stream_options={"include_usage": True}, **SAMPLING["seeded"],
        extra_body={"prediction": {"type": "content", "content": plain_text}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain_text
    accepted, rejected = _counts(chunks[-1].usage)
    assert accepted > 0
    engine = server.service.engine
    deadline = time.monotonic() + 60
    while (engine.active_rows, engine.waiting) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (engine.active_rows, engine.waiting) == (0, 0) and engine.running  # the left streams' rows are free


def test_prediction_on_a_plain_program_is_served_without_drafts(plain_server, programs, tokenizer):
    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[1])
    plain_text = tokenizer.decode(_plain_tokens(programs, prompt_ids, _params(tokenizer, "greedy")))
    r = _client(plain_server).completions.create(
        model="plain", prompt=PROMPTS[1], max_tokens=TOKENS, logit_bias=_no_eos(tokenizer), temperature=0,
        extra_body={"prediction": {"type": "content", "content": plain_text}})
    assert r.choices[0].text == plain_text
    assert _counts(r.usage) == (0, 0)


@pytest.mark.parametrize("prediction", [
    "some text",
    {"type": "text", "content": "x"},
    {"type": "content"},
    {"type": "content", "content": 5},
    {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
    {"type": "content", "content": [{"type": "text", "text": 3}]},
    {"type": "content", "content": "x", "extra": 1},
])
def test_bad_prediction_shapes_are_400s_naming_it(server, prediction):
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).completions.create(model="draft", prompt="Hi", max_tokens=2,
                                           extra_body={"prediction": prediction})
    error = info.value.body
    assert error["param"] == "prediction" and "'prediction' must be" in error["message"]
    assert "\n" not in error["message"]


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
    ("structured_outputs", {"regex": "[ab]+"}),
])
def test_structured_output_on_a_draft_program_without_the_mask_is_a_400(server, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(model="draft", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, extra_body={field: value})
    error = info.value.body
    assert error["param"] == field and "--sampler ...,mask" in error["message"] and "\n" not in error["message"]


@pytest.fixture(scope="module")
def masked_server(tmp_path_factory, tokenizer):
    """A batched draft-verifying program with the mask input (structured output), and its plain twin."""
    out = tmp_path_factory.mktemp("serve_speculative_masked")
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id)
    config = SamplerConfig(top_k=True, top_p=True, allowed_mask=True)
    paths = {"plain": out / "plain.pte", "draft": out / "draft.pte"}
    export_decoder(model, paths["plain"], MAX_SEQ_LEN, config=config, tokenizer=tokenizer)
    export_decoder(model, paths["draft"], MAX_SEQ_LEN, config=config, batch=BATCH, tokenizer=tokenizer,
                   draft_tokens=K)
    with bit_exact_batching():
        srv = ServerThread(paths["draft"], model_name="draft").start()
    yield srv, paths
    srv.stop()


def test_structured_output_with_a_prediction_is_the_plain_mask_programs(masked_server, tokenizer):
    """A regex-constrained completion on a draft program: the plain mask program's text, its prediction (that
    text) accepted, reported in usage; two concurrent requests, one constrained and one not, both exact."""
    from backends.mlx.llm.decoder.constraints import Constraint

    srv, paths = masked_server
    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[0])
    regex = "[a-c]{3,8}-[0-9]{2,5}"
    with bit_exact_batching():
        plain = Decoder(paths["plain"]).generate(prompt_ids, TOKENS, constraint=Constraint("regex", regex)).tokens
    text = tokenizer.decode(plain, skip_special_tokens=True)
    assert re.fullmatch(regex, text), text
    client = _client(srv)
    body = {"structured_outputs": {"regex": regex}, "prediction": {"type": "content", "content": text}}
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(client.completions.create, model="draft", prompt=PROMPTS[0], max_tokens=TOKENS,
                                  temperature=0, extra_body=body)
        free = pool.submit(client.completions.create, model="draft", prompt=PROMPTS[1], max_tokens=8,
                           temperature=0)
        r, other = constrained.result(), free.result()
    assert r.choices[0].text == text
    accepted, rejected = _counts(r.usage)
    assert accepted > 0
    with bit_exact_batching():
        alone = Decoder(paths["plain"]).generate(prompt_rules.encode_prompt(tokenizer, PROMPTS[1]), 8).tokens
    assert other.choices[0].text == tokenizer.decode(alone, skip_special_tokens=True)


def test_each_choice_follows_its_own_prediction_cursor(server, programs, tokenizer):
    """n = 2 seeded choices (seeds s and s + max_seq_len) share one prediction: each choice is its plain tokens,
    and usage sums both rows' counts."""
    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[0])
    seeds = [3, 3 + MAX_SEQ_LEN]
    texts = [tokenizer.decode(_plain_tokens(programs, prompt_ids, SamplingParams(
        temperature=0.8, seed=s, top_p=0.9, logit_bias={tokenizer.eos_token_id: -100.0}))) for s in seeds]
    assert texts[0] != texts[1]
    r = _client(server).completions.create(model="draft", prompt=PROMPTS[0], max_tokens=TOKENS, n=2,
                                           logit_bias=_no_eos(tokenizer), **SAMPLING["seeded"],
                                           extra_body={"prediction": {"type": "content", "content": texts[0]}})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == texts
    counts = [0, 0]
    for s, text in zip(seeds, texts):
        params = SamplingParams(temperature=0.8, seed=s, top_p=0.9, logit_bias={tokenizer.eos_token_id: -100.0})
        draft = PredictionDraft(tokenizer.encode(texts[0], add_special_tokens=False))
        _, proposed, accepted = _speculative_stats(programs, prompt_ids, params, draft)
        counts = [counts[0] + accepted, counts[1] + proposed - accepted]
    assert _counts(r.usage) == tuple(counts) and counts[0] > 0


def test_lmtp_generate_drafts_by_prompt_lookup(server, programs, tokenizer):
    import asyncio

    prompt_ids = prompt_rules.encode_prompt(tokenizer, PROMPTS[1])
    plain = _plain_tokens(programs, prompt_ids, _params(tokenizer, "seeded"))
    request = {"stream_id": 1, "prompt": prompt_ids, "max_tokens": TOKENS, **SAMPLING["seeded"],
               "logit_bias": _no_eos(tokenizer)}

    def finished(messages):
        return any(kind == "TOKEN" and any(e.get("finish_reason") for e in payload) for kind, payload in messages)

    messages = asyncio.run(lmtp_exchange(server, ["GENERATE " + json.dumps(request)], finished))
    tokens = [e["token"] for kind, payload in messages if kind == "TOKEN" for e in payload
              if e.get("token") is not None]
    assert tokens == plain


def _stop_in(tokenizer, plain: list[int], first: int) -> tuple[str, int]:
    """A stop string from a token of `plain` at or after `first` (whole characters), and how many tokens are
    fed until the text holds it; drafts of the prediction go on past it."""
    for j in range(first, TOKENS - K):
        stop = tokenizer.decode(plain[j:j + 1]).strip()
        if stop and "\ufffd" not in stop:
            upto = next(m for m in range(1, TOKENS + 1) if stop in tokenizer.decode(plain[:m]))
            if upto < TOKENS - K:
                return stop, upto
    raise AssertionError(f"no stop string in {tokenizer.decode(plain)!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("where", ["early", "later"])
def test_prediction_counts_end_at_the_stop_string(server, programs, tokenizer, stream, where):
    """A stop string ends the reply, perhaps inside a verifying call whose accepted drafts run past it: usage
    counts the drafts behind the returned text only (test_decode_rows_core.py checks the counts per token), so
    every accepted prediction token is a returned token (it counted 8 accepted for 1 completion token)."""
    prompt = f"{where} {stream}: once upon a time"
    prompt_ids = prompt_rules.encode_prompt(tokenizer, prompt)
    params = _params(tokenizer, "greedy")
    plain = _plain_tokens(programs, prompt_ids, params)
    plain_text = tokenizer.decode(plain)
    stop, upto = _stop_in(tokenizer, plain, 1 if where == "early" else 6)
    body = dict(model="draft", prompt=prompt, max_tokens=TOKENS, logit_bias=_no_eos(tokenizer), stop=[stop],
                extra_body={"prediction": {"type": "content", "content": plain_text}}, temperature=0)
    if stream:
        chunks = list(_client(server).completions.create(stream=True, stream_options={"include_usage": True},
                                                         **body))
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
        r = _client(server).completions.create(**body)
        text, usage = r.choices[0].text, r.usage
    assert text == plain_text[:plain_text.index(stop)]
    assert usage.completion_tokens == upto
    accepted, _ = _counts(usage)
    assert accepted <= upto
