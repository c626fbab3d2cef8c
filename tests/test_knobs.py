"""The knob table (llm/sampler/knobs.py) drives every path: program inputs, SamplingParams, the OpenAI
and LMTP parameters, the `etmlx generate` flags and etmlx_decode's flags. Every case below is
generated from the table, so a new knob is checked everywhere without new test code."""

from __future__ import annotations

import argparse
import math
import subprocess
from pathlib import Path

import pytest
import torch

from backends.mlx.cli.knob_flags import params_from_args
from backends.mlx.cli.llm_commands import add_parsers
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import BY_NAME, DTYPES, INT64_MAX, KNOBS, SEED_LIMIT, USER_KNOBS, Knob, KnobError
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.api_errors import ApiError
from backends.mlx.serve.lmtp_session import generate_params
from backends.mlx.serve.openai_params import build_job

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
VOCAB = 50
# Every feature of the table on (width features take 2 pairs / ids per row).
ALL = SamplerConfig(**{k.feature: 2 if k.width else True for k in KNOBS if k.feature})
SCALARS = [k for k in USER_KNOBS if not k.width]


def _meta(config: SamplerConfig) -> DecoderMeta:
    return DecoderMeta.build(max_seq_len=64, vocab_size=VOCAB, batch=1, eos_token_ids=[], seeded=True, config=config,
                             dtype="float32")


def _step(knob: Knob):
    return 1 if knob.integer else 1e-3


def edges(knob: Knob, low=None, high=None) -> tuple[list, list]:
    """Values at and just past each end of the range: (accepted, rejected)."""
    low = knob.low if low is None else low
    high = knob.high if high is None else high
    inside, outside = [knob.off], []
    if low is not None:
        (outside if knob.low_open else inside).append(low)
        outside.append(low - _step(knob))
    if high is not None:
        (outside if knob.high_open else inside).append(high)
        outside.append(high + _step(knob))
    if knob.integer:
        outside += [10 ** 30, -(10 ** 30)]  # beyond int64
    else:
        outside.append(math.nan)
    return inside, outside


def some_on(knob: Knob):
    """A valid value other than off."""
    if knob.width:
        return {3: 1.5}
    inside, _ = edges(knob)
    candidates = inside + [knob.off + _step(knob), knob.off - _step(knob)]
    return next(v for v in candidates if v != knob.off and knob.in_range(v))


def test_table_is_consistent():
    assert len(BY_NAME) == len(KNOBS)
    for knob in KNOBS:
        assert knob.dtype in DTYPES and all(i.dtype in DTYPES for i in knob.program_inputs)
        assert knob.in_range(knob.off) or knob.width, knob.name
        assert knob.doc and (knob.flag or not (knob.api and knob.feature))  # a caller's knob names its flag
        if knob.integer and knob.high is not None:
            assert knob.high <= INT64_MAX
    assert BY_NAME["seed"].high + 2 ** 40 < INT64_MAX  # seed + step never overflows
    # The input order of programs already exported.
    assert ALL.knob_names() == ["top_k", "top_p", "min_p", "bias_ids", "bias_values", "presence_penalty",
                                "frequency_penalty", "repetition_penalty", "penalty_reset", "penalty_add",
                                "allowed_mask"]


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.feature], ids=lambda k: k.name)
def test_a_feature_adds_exactly_its_knob_inputs(knob):
    alone = SamplerConfig(**{knob.feature: 2 if knob.width else True},
                          **({"penalties": True} if knob.feature == "penalty_seed" else {}))
    names = alone.knob_names()
    assert all(i.name in names for i in knob.program_inputs)
    assert not any(i.name in SamplerConfig().knob_names() for i in knob.program_inputs)


def test_the_exported_program_takes_the_tables_inputs():
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
    from backends.mlx.runtime.runner import load_method

    result = export_sampling_head(LogitsInput(), (torch.zeros(2, VOCAB),), per_row=True, config=ALL)
    meta = load_method(result.pte).method.method_meta()
    names = ["logits", "temperature", "seed", *ALL.knob_names()]
    assert meta.num_inputs() == len(names)
    dtypes = {i.name: i.dtype for k in KNOBS for i in k.program_inputs}
    codes = {"int64": 4, "float32": 6, "int32": 3}  # ExecuTorch ScalarType Long, Float, Int
    for index, name in enumerate(names[1:], start=1):
        assert meta.input_tensor_meta(index).dtype() == codes[dtypes[name]], name


@pytest.mark.parametrize("knob", SCALARS, ids=lambda k: k.name)
def test_sampling_params_take_the_range_and_refuse_the_rest(knob):
    inside, outside = edges(knob)
    for value in inside:
        assert getattr(SamplingParams(**{knob.name: value}), knob.name) == value
    for value in outside + [True, "1"]:
        with pytest.raises((KnobError, TypeError)) as info:
            SamplingParams(**{knob.name: value})
        assert knob.name in str(info.value), value


def test_seed_leaves_room_for_the_steps_and_bias_is_checked():
    SamplingParams(seed=SEED_LIMIT)
    for seed in (2 ** 63 - 1, 2 ** 63 - 10, SEED_LIMIT + 1, -(2 ** 63)):
        with pytest.raises(KnobError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(logit_bias={0: -100, 7: 100})
    for bad in ({1: 100.5}, {1: math.nan}, {-1: 1.0}, {True: 1.0}, {1: "x"}, [1, 2]):
        with pytest.raises(KnobError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(KnobError, match=rf"\[0, {VOCAB}\)"):
        SamplingParams(logit_bias={VOCAB: 1.0}).check(ALL, VOCAB)


def _openai(body: dict, config: SamplerConfig = ALL):
    return build_job({"prompt": [1], **body}, _meta(config), [1], chat=False).choices[0]


@pytest.mark.parametrize("knob", SCALARS, ids=lambda k: k.name)
def test_openai_accepts_the_edges_and_refuses_the_rest_with_a_400(knob):
    inside, outside = edges(knob, knob.openai_low, knob.openai_high)
    for value in inside:
        expected = knob.off if knob.openai_low is not None and value < knob.low else value
        assert getattr(_openai({knob.name: value}), knob.name) == expected
    for value in outside + ([] if knob.integer else [math.inf]) + ["x"]:
        with pytest.raises(ApiError) as info:
            _openai({knob.name: value})
        assert info.value.status == 400 and info.value.param == knob.name, value


def test_openai_logit_bias_edges():
    assert _openai({"logit_bias": {"0": -100, str(VOCAB - 1): 100}}).logit_bias == {0: -100, VOCAB - 1: 100}
    for bad in ({"1": 101}, {"1": -100.5}, {str(VOCAB): 1}, {"-1": 1}, {"x": 1}, [1]):
        with pytest.raises(ApiError) as info:
            _openai({"logit_bias": bad})
        assert info.value.status == 400 and info.value.param == "logit_bias", bad


@pytest.mark.parametrize("knob", [k for k in USER_KNOBS if k.feature], ids=lambda k: k.name)
def test_a_knob_the_program_lacks_is_refused_naming_the_export_flag(knob):
    value = some_on(knob)
    body = {knob.name: {str(k): v for k, v in value.items()} if knob.width else value}
    with pytest.raises(ApiError) as info:
        _openai(body, SamplerConfig())
    assert info.value.param == knob.name and f"--sampler {knob.flag}" in info.value.message
    with pytest.raises(KnobError, match=f"--sampler {knob.flag}"):
        SamplingParams(**{knob.name: value}).check(SamplerConfig(), VOCAB)
    _openai({knob.name: body[knob.name]}, ALL)  # and is taken by a program that has it


@pytest.mark.parametrize("knob", USER_KNOBS, ids=lambda k: k.name)
def test_lmtp_takes_every_knob_by_name(knob):
    value = some_on(knob)
    payload = {knob.name: {str(k): v for k, v in value.items()} if knob.width else value}
    assert getattr(generate_params(payload), knob.name) == value
    if not knob.width:
        for bad in edges(knob)[1]:
            with pytest.raises(ValueError, match=knob.name):
                generate_params({knob.name: bad})


def _generate_args(*flags):
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    return parser.parse_args(["generate", "x.pte", "--prompt-ids", "1", *map(str, flags)])


def test_cli_has_a_flag_per_knob():
    # The flag names users already type keep working.
    for flag in ("--temperature", "--seed", "--top-k", "--top-p", "--min-p", "--presence-penalty",
                 "--frequency-penalty", "--repetition-penalty"):
        assert flag in {k.flag_name for k in USER_KNOBS}
    assert params_from_args(_generate_args()) == SamplingParams()


@pytest.mark.parametrize("knob", [k for k in SCALARS if k.flag_name], ids=lambda k: k.name)
def test_cli_flag_edges(knob):
    inside, outside = edges(knob)
    for value in inside:
        assert getattr(params_from_args(_generate_args(knob.flag_name, value)), knob.name) == value
    for value in outside:
        with pytest.raises(KnobError, match=knob.name):
            params_from_args(_generate_args(knob.flag_name, value))


@pytest.fixture(scope="module")
def full_pte(tmp_path_factory) -> Path:
    """A tiny decoder with every feature of the table, metadata inside: etmlx_decode checks its knob flags
    against the metadata's knob list before the method loads."""
    from backends.mlx.llm.builtin.tiny_model import tiny_llama
    from backends.mlx.llm.decoder.export import export_decoder

    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is not built: run `make setup`")
    pte = tmp_path_factory.mktemp("knobs") / "full.pte"
    export_decoder(tiny_llama(VOCAB, 0, hidden=16, layers=1), pte, 16, config=ALL)
    return pte


def _decode(pte, *args):
    return subprocess.run([str(BINARY), str(pte), "--prompt-ids", "1", "--max-tokens", "1", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("knob", [k for k in SCALARS if k.flag_name], ids=lambda k: k.name)
@pytest.mark.subprocess
def test_etmlx_decode_flags_come_from_the_metadata(full_pte, knob):
    inside, outside = edges(knob)
    for value in inside:  # accepted: one token decoded
        done = _decode(full_pte, knob.flag_name, value)
        assert done.returncode == 0, done.stderr
    for value in outside:
        done = _decode(full_pte, knob.flag_name, value)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"etmlx_decode: error: {knob.flag_name} must be {knob.range_text()}")
