"""build/etmlx_decode (the C++ decode loop, no Python) gives the Python Decoder's tokens, reads the metadata (a
DecoderMeta flatbuffer) and tokenizer inside the .pte and refuses a program without them; bad input fails cleanly. Programs export
pipelined by default (each call returns the previous call's token); the same model exported unpipelined must give
the same tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import META_KEY, OLD_META_KEY, DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import rewrite_named_data

pytestmark = pytest.mark.subprocess  # build/etmlx_decode runs

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
MAX_SEQ_LEN = 48
VOCAB = 80
PROMPT = [7, 1, 33, 20]


def _run(*args):
    assert BINARY.is_file(), f"{BINARY} is missing: `make setup` builds it"
    return subprocess.run([str(BINARY), *map(str, args)], capture_output=True, text=True, timeout=120)


def _ids(done) -> list[int]:
    assert done.returncode == 0, done.stderr[-2000:]
    return [int(t) for t in done.stdout.split()]


def _without_metadata(pte: Path, out: Path) -> Path:
    """A copy of `pte` whose metadata key is renamed (same length, so the file stays valid): it carries none."""
    data = pte.read_bytes()
    assert data.count(META_KEY.encode()) == 1
    out.write_bytes(data.replace(META_KEY.encode(), META_KEY.encode()[:-4] + b"gone"))
    return out


def _with_meta(pte: Path, out: Path, blob: bytes) -> Path:
    """A copy of `pte` carrying `blob` as its metadata."""
    return rewrite_named_data(pte, out, {META_KEY: blob})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        eos_token_id=None, bos_token_id=None)).eval()


@pytest.fixture(scope="module")
def pte(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpp_decode") / "llama.pte"
    export_decoder(model, out, MAX_SEQ_LEN)
    assert DecoderMeta.load(out).pipelined  # the default without the mask input
    return out


@pytest.fixture(scope="module")
def plain_pte(model, tmp_path_factory) -> Path:
    """The same model unpipelined: what programs exported before pipelining look like."""
    out = tmp_path_factory.mktemp("cpp_decode_plain") / "llama.pte"
    export_decoder(model, out, MAX_SEQ_LEN, pipelined=False)
    assert not DecoderMeta.load(out).pipelined
    return out


# Every knob, logit bias, penalty seeding and logprob outputs: the runner must fill them all.
FULL = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=2, penalties=True, penalty_seed=4, logprobs=3)


@pytest.fixture(scope="module")
def full_pte(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpp_decode_full") / "full.pte"
    export_decoder(model, out, MAX_SEQ_LEN, config=FULL)
    return out


@pytest.fixture(scope="module")
def full_plain_pte(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpp_decode_full_plain") / "full.pte"
    export_decoder(model, out, MAX_SEQ_LEN, config=FULL, pipelined=False)
    return out


@pytest.fixture(scope="module")
def decoder(pte) -> Decoder:
    return Decoder(pte)


def test_greedy_matches_python_decoder(pte, decoder):
    expected = decoder.generate(PROMPT, 20).tokens
    assert len(expected) == 20
    assert _ids(_run(pte, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", 20)) == expected


@pytest.mark.parametrize("seed", [42, 7])
def test_seeded_sampling_matches_python_decoder(pte, decoder, seed):
    expected = decoder.generate(PROMPT, 16, SamplingParams(temperature=1.0, seed=seed)).tokens
    # Sampling at T=1 must not be the greedy path, or this test would not check the seeds.
    assert expected != decoder.generate(PROMPT, 16).tokens
    got = _ids(_run(pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 16, "--temperature", 1.0, "--seed", seed))
    assert got == expected


def test_json_output_and_eos_stop(pte, decoder):
    greedy = decoder.generate([5, 6], 12).tokens
    stop_id = greedy[3]
    first_stop = greedy.index(stop_id)
    done = _run(pte, "--prompt-ids", "5,6", "--max-tokens", 12, "--eos", stop_id, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == greedy[:first_stop + 1] and result["finish_reason"] == "stop"
    full = json.loads(_run(pte, "--prompt-ids", "5,6", "--max-tokens", 12, "--json").stdout)
    assert full["tokens"] == greedy and full["finish_reason"] == "length"


def test_a_program_without_this_metadata_is_refused(plain_pte, tmp_path):
    """No compatibility path: a program without metadata, with the JSON of older exports, or with a FILE.pte.json
    sidecar beside it, is refused with one line saying to re-export it."""
    meta = DecoderMeta.load(plain_pte)
    alone = _without_metadata(plain_pte, tmp_path / "alone.pte")
    Path(str(alone) + ".json").write_text(json.dumps(dataclasses.asdict(meta)))  # a sidecar, as older exports wrote
    json_era = rewrite_named_data(plain_pte, tmp_path / "json_era.pte",
                                  {META_KEY: None, OLD_META_KEY: json.dumps(dataclasses.asdict(meta)).encode()})
    for program, what in ((alone, "no etmlx decoder metadata"), (json_era, "older etmlx metadata (JSON)")):
        done = _run(program, "--prompt-ids", "7,1,33,20", "--max-tokens", 4)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.strip() == f"etmlx_decode: error: {program} carries {what}: re-export it with `etmlx export`"
    # The control: the same file with its metadata back decodes.
    restored = _with_meta(alone, tmp_path / "restored.pte", meta.to_bytes())
    assert len(_ids(_run(restored, "--prompt-ids", "7,1,33,20", "--max-tokens", 4))) == 4


@pytest.mark.parametrize("args, code, message", [
    (["--prompt-ids", "1,2,3", "--max-tokens", 60], 2, "exceeds max_seq_len 48"),
    (["--prompt-ids", "", "--max-tokens", 3], 2, "--prompt-ids is empty"),
    (["--prompt-ids", "1,x"], 2, "'x' is not an integer token id"),
    (["--prompt-ids", "1,500"], 2, "token ids in [0, 80), got 500"),
    (["--prompt-ids", "-1"], 2, "token ids in [0, 80), got -1"),
    (["--prompt-ids", "1", "--max-tokens", 0], 2, "--max-tokens must be an integer >= 1"),
    (["--prompt-ids", "1", "--temperature", "warm"], 2, "--temperature must be a number >= 0"),
    (["--prompt-ids", "1", "--temperature", -1], 2, "--temperature must be a number >= 0"),
    (["--prompt-ids", "1", "--top-p", 0], 2, "--top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--top-k", -3], 2, "--top-k must be an integer >= 0"),
    (["--prompt-ids", "1", "--repetition-penalty", 0], 2, "--repetition-penalty must be a number > 0"),
    (["--prompt-ids", "1", "--max-tokens", 3, "--top-k", 5], 2, "exported without top_k"),
    (["--prompt-ids", "1", "--frobnicate", 1], 2, "unknown option --frobnicate"),
    (["--max-tokens", 3], 2, "--prompt or --prompt-ids is required"),
    (["--prompt", "hi", "--prompt-ids", "1"], 2, "give --prompt or --prompt-ids, not both"),
    (["--prompt", "hi"], 2, "llama.pte has no tokenizer: give --prompt-ids"),
])
def test_bad_command_line(pte, args, code, message):
    done = _run(pte, *args)
    assert done.returncode == code and message in done.stderr, done.stderr
    assert done.stdout == ""


def test_bad_files(pte, tmp_path):
    missing = _run(tmp_path / "nope.pte", "--prompt-ids", "1")
    assert missing.returncode == 2 and "nope.pte: no such file" in missing.stderr
    truncated = tmp_path / "truncated.pte"
    truncated.write_bytes(pte.read_bytes()[:1000])
    bad = _run(truncated, "--prompt-ids", "1")
    assert bad.returncode == 1 and "is not a loadable ExecuTorch program" in bad.stderr
    meta = DecoderMeta.load(pte)
    mystery = dataclasses.replace(meta, inputs=meta.inputs[:-1] + ["mystery"])
    unknown = _run(_with_meta(pte, tmp_path / "copy.pte", mystery.to_bytes()), "--prompt-ids", "1")
    assert unknown.returncode == 2 and "input 'mystery' is not one etmlx_decode knows" in unknown.stderr


def _knob_edit(meta, **change):
    knobs = [dict(k) for k in meta.knobs]
    knobs[0].update(change)
    return dataclasses.replace(meta, knobs=knobs).to_bytes()


@pytest.mark.parametrize("edit, message", [
    (lambda m: b"[" * 200, "is not etmlx decoder metadata (a DecoderMeta flatbuffer, identifier EMDM)"),
    (lambda m: m.to_bytes()[:48], "is not etmlx decoder metadata (a DecoderMeta flatbuffer"),
    (lambda m: dataclasses.replace(m, format="etmlx-decoder/9").to_bytes(), 'format "etmlx-decoder/1" expected'),
    (lambda m: dataclasses.replace(m, max_seq_len=0).to_bytes(), "max_seq_len, vocab_size, batch and verify_min_width"),
    (lambda m: dataclasses.replace(m, batch=4).to_bytes(), "says batch 4 but the program decodes 1 rows per call"),
    (lambda m: dataclasses.replace(m, max_seq_len=47).to_bytes(),
     "says max_seq_len 47 but the program's tokens input holds 48"),
    (lambda m: dataclasses.replace(m, max_seq_len=100000).to_bytes(),
     "says max_seq_len 100000 but the program's tokens input holds 48"),
    (lambda m: dataclasses.replace(m, knobs=[]).to_bytes(), 'the metadata lists no "knobs"'),
    (lambda m: _knob_edit(m, dtype="int8"), '"knobs"[0]: dtype must be int64, int32 or float32, got int8'),
    (lambda m: _knob_edit(m, flag="temperature"), '"knobs"[0]: "flag" must start with --'),
], ids=["not_a_flatbuffer", "truncated", "format", "zero_length", "batch", "short", "long", "no_knobs",
        "knob_dtype", "knob_flag"])
def test_malformed_metadata(pte, tmp_path, edit, message):
    copy = _with_meta(pte, tmp_path / "copy.pte", edit(DecoderMeta.load(pte)))
    done = _run(copy, "--prompt-ids", "1")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_a_sidecar_beside_the_program_is_not_read(pte, decoder, tmp_path):
    copy = tmp_path / "copy.pte"
    shutil.copy(pte, copy)
    Path(str(copy) + ".json").write_text("not json: never read, the program carries its metadata")
    assert _ids(_run(copy, "--prompt-ids", "7,1,33,20", "--max-tokens", 5)) == decoder.generate(PROMPT, 5).tokens


def test_knobs_off_by_default_in_a_full_sampler_program(full_pte, decoder):
    # With every knob at its off value the full program samples exactly as the plain one.
    greedy = decoder.generate(PROMPT, 12).tokens
    seeded = decoder.generate(PROMPT, 12, SamplingParams(temperature=1.0, seed=42)).tokens
    assert _ids(_run(full_pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 12)) == greedy
    assert _ids(_run(full_pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 12, "--temperature", 1,
                     "--seed", 42)) == seeded


def test_knobs_match_python_decoder(full_pte):
    params = SamplingParams(temperature=1.5, seed=5, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.25)
    expected = Decoder(full_pte).generate(PROMPT, 16, params).tokens
    assert expected != Decoder(full_pte).generate(PROMPT, 16, SamplingParams(temperature=1.5, seed=5)).tokens
    got = _ids(_run(full_pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 16, "--temperature", 1.5, "--seed", 5,
                    "--top-k", 5, "--top-p", 0.9, "--min-p", 0.05, "--repetition-penalty", 1.3,
                    "--presence-penalty", 0.5, "--frequency-penalty", 0.25))
    assert got == expected


@pytest.fixture(scope="module")
def batched_pte(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpp_decode_batched") / "batched.pte"
    export_decoder(model, out, MAX_SEQ_LEN, config=FULL, batch=3)
    return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=42),
                                    SamplingParams(temperature=1.5, seed=5, top_k=5, top_p=0.9, presence_penalty=0.5)],
                         ids=["greedy", "seeded", "knobs"])
def test_batched_program_runs_one_sequence(batched_pte, full_pte, params):
    # Row 0 carries the sequence, the idle rows must not disturb it: the batch-1 program's tokens.
    expected = Decoder(full_pte).generate(PROMPT, 14, params).tokens
    args = ["--temperature", params.temperature, "--seed", params.seed]
    if params.top_k:
        args += ["--top-k", params.top_k, "--top-p", params.top_p, "--presence-penalty", params.presence_penalty]
    assert _ids(_run(batched_pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 14, *args)) == expected
    assert Decoder(batched_pte).generate(PROMPT, 14, params).tokens == expected


@pytest.fixture(scope="module")
def text_pte(tmp_path_factory):
    """The built-in model's kind of tokenizer (BOS added by its template) inside a renamed .pte, nothing beside it."""
    from backends.mlx.llm.builtin.tiny_model import tiny_llama
    from backends.mlx.llm.builtin.tokenizer import train_tokenizer

    docs = ["One morning, Mira went to the market and bought bread. <|eos|>",
            "The sun was warm; Mira smiled at the baker. Caf\u00e9 \u65e5\u672c \U0001f642"] * 20
    tokenizer = train_tokenizer(docs, 300)
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, layers=1, seed=2)
    root = tmp_path_factory.mktemp("cpp_text")
    export_decoder(model, root / "text.pte", MAX_SEQ_LEN, tokenizer=tokenizer)
    (root / "text.pte").rename(root / "renamed.bin")
    return root / "renamed.bin", tokenizer


@pytest.mark.parametrize("extra", [[], ["--temperature", 1.0, "--seed", 9]], ids=["greedy", "seeded"])
def test_prompt_text_uses_the_tokenizer_inside_the_pte(text_pte, extra):
    pte, tokenizer = text_pte
    assert sorted(p.name for p in pte.parent.iterdir()) == ["renamed.bin"]
    prompt = "One morning, Mira went to Caf\u00e9 \U0001f642"
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # the template's BOS, which etmlx_decode must add too
    params = SamplingParams(temperature=float(extra[1]), seed=extra[3]) if extra else SamplingParams()
    expected = Decoder(pte).generate(ids, 12, params).tokens
    done = _run(pte, "--prompt", prompt, "--max-tokens", 12, "--json", *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""  # the tokenizer library's own log lines are muted
    result = json.loads(done.stdout)
    assert result["prompt_ids"] == ids and result["tokens"] == expected
    assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    streamed = subprocess.run([str(BINARY), str(pte), "--prompt", prompt, "--max-tokens", "12", *map(str, extra)],
                              capture_output=True, timeout=120)
    assert streamed.returncode == 0 and streamed.stderr == b""
    text = [t for t in expected if t not in tokenizer.all_special_ids]
    assert streamed.stdout.decode("utf-8", errors="replace") == tokenizer.decode(text) + "\n"


def test_a_missing_tokenizer_plugin_fails_clearly(text_pte):
    """The tokenizer is a plugin loaded on demand: without it text prompts fail in one line, ids still decode."""
    pte, _ = text_pte
    env = {**os.environ, "ETMLX_TEXT_TOKENIZER_PLUGIN": "/nonexistent/libetmlx_text_tokenizer.so"}
    done = subprocess.run([str(BINARY), str(pte), "--prompt", "One morning", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=120, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cannot load the tokenizer plugin /nonexistent/libetmlx_text_tokenizer.so" in lines[0]
    ids = subprocess.run([str(BINARY), str(pte), "--prompt-ids", "1,2", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert ids.returncode == 0 and ids.stderr == "" and len(ids.stdout.split()) == 2, ids.stderr


_KNOB_FLAGS = ["--top-k", 5, "--top-p", 0.9]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=42),
                                    SamplingParams(temperature=1.5, seed=5, top_k=5, top_p=0.9)],
                         ids=["greedy", "seeded", "top_k_top_p"])
def test_pipelined_gives_the_unpipelined_tokens(full_pte, full_plain_pte, params):
    """Pipelined: each call returns the token of the call before it. Same tokens as the Python Decoder on either
    program and as etmlx_decode on the unpipelined export, one for one."""
    assert DecoderMeta.load(full_pte).pipelined and not DecoderMeta.load(full_plain_pte).pipelined
    expected = Decoder(full_plain_pte).generate(PROMPT, 16, params).tokens
    assert Decoder(full_pte).generate(PROMPT, 16, params).tokens == expected
    args = ["--prompt-ids", "7,1,33,20", "--max-tokens", 16, "--temperature", params.temperature, "--seed", params.seed]
    if params.top_k:
        args += _KNOB_FLAGS
    for program in (full_pte, full_plain_pte):
        done = _run(program, *args, "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout)
        assert result["tokens"] == expected and result["finish_reason"] == "length"
        assert result["time_to_first_token_s"] > 0 and result["decode_tokens_per_s"] > 0


def test_pipelined_eos_stop_and_one_token(pte, plain_pte, decoder):
    greedy = Decoder(plain_pte).generate([5, 6], 12).tokens
    assert decoder.generate([5, 6], 12).tokens == greedy
    for program in (pte, plain_pte):
        one = json.loads(_run(program, "--prompt-ids", "5,6", "--max-tokens", 1, "--json").stdout)
        assert one["tokens"] == greedy[:1] and one["finish_reason"] == "length"
        assert one["decode_tokens_per_s"] == 0 and one["time_to_first_token_s"] > 0
        first = json.loads(_run(program, "--prompt-ids", "5,6", "--max-tokens", 12, "--eos", greedy[0],
                                "--json").stdout)
        assert first["tokens"] == greedy[:1] and first["finish_reason"] == "stop"
        stop_id = greedy[5]
        stopped = json.loads(_run(program, "--prompt-ids", "5,6", "--max-tokens", 12, "--eos", stop_id,
                                  "--json").stdout)
        assert stopped["tokens"] == greedy[:greedy.index(stop_id) + 1] and stopped["finish_reason"] == "stop"
        assert _ids(_run(program, "--prompt-ids", "5,6", "--max-tokens", 12)) == greedy


def test_the_pipelined_flag_comes_from_the_metadata(pte, decoder, tmp_path):
    """etmlx_decode drives a program as its metadata's "pipelined" says: the pipelined program described as
    unpipelined no longer gives the decoder's tokens (while its own metadata does)."""
    expected = decoder.generate(PROMPT, 8).tokens
    assert _ids(_run(pte, "--prompt-ids", "7,1,33,20", "--max-tokens", 8)) == expected
    unpiped = dataclasses.replace(DecoderMeta.load(pte), pipelined=False)
    done = _run(_with_meta(pte, tmp_path / "wrong.pte", unpiped.to_bytes()), "--prompt-ids", "7,1,33,20",
                "--max-tokens", 8)
    assert done.returncode != 0 or _ids(done) != expected


@pytest.mark.parametrize("text", ["a" * 1_000_000, "\U0001f642" * 1_000_000, " " * 1_000_000 + "a",
                                  ("word " * 300 + "x" * 8_190 + "<|eos|>" + "y" * 9_000) * 3],
                         ids=["one_word", "emoji", "spaces", "runs_around_a_special_token"])
def test_a_million_characters_without_a_break_tokenize(text_pte, tmp_path, text):
    """The tokenizer library's std::regex matcher recursed once per character of a pre-token and overflowed
    the stack at ~40,000 (SIGSEGV): runs over 4,096 bytes are cut (long_runs.h). The prompt is tokenized (its
    token count is the error naming the program's 48-token input) as the Python tokenizer counts it, a special
    token inside a long run stays whole (the x run puts a cut at 8,192 bytes, inside '<|eos|>', unless it
    moves)."""
    pte, tokenizer = text_pte
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text, encoding="utf-8")
    done = _run(pte, "--prompt-file", prompt, "--max-tokens", 2)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    expected = len(tokenizer(text, add_special_tokens=True)["input_ids"])
    assert f"prompt ({expected} tokens) is longer than the program's {MAX_SEQ_LEN}-token input" in lines[0]


def test_a_long_prediction_tokenizes(tmp_path_factory, text_pte):
    """--prediction @FILE goes through the same tokenizer: a million emoji are drafts, the tokens unchanged."""
    from backends.mlx.llm.builtin.tiny_model import tiny_llama

    _, tokenizer = text_pte
    root = tmp_path_factory.mktemp("cpp_prediction")
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, layers=1, seed=2)
    export_decoder(model, root / "draft.pte", MAX_SEQ_LEN, tokenizer=tokenizer, draft_tokens=2, verify=False)
    prediction = root / "prediction.txt"
    prediction.write_text("\U0001f642" * 1_000_000, encoding="utf-8")
    plain = _run(root / "draft.pte", "--prompt", "One morning", "--max-tokens", 8, "--draft", "none", "--json")
    drafted = _run(root / "draft.pte", "--prompt", "One morning", "--max-tokens", 8, "--prediction",
                   f"@{prediction}", "--json")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr[-2000:]
    assert json.loads(drafted.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
