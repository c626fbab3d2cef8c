"""The sample-check-resample baseline of `etmlx bench structured --builtin` produces what the grammar allows.

A random-weight model's free samples are nearly always rejected by a JSON schema, so the baseline's
resample path is exercised (and counted); every completion must end with EOS and parse as JSON valid
for the schema, as the mask-on-the-device path does.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.structured import SCHEMA
from benchmarks.structured_builtin import check_resample, decode_rate
from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.constraints import Constraint
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams

pytestmark = pytest.mark.bench  # the structured-output benchmark


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
    pte = tmp_path_factory.mktemp("bench_structured") / "masked.pte"
    export_decoder(model, pte, 128, config=SamplerConfig(top_k=True, allowed_mask=True), tokenizer=tok)
    return Decoder(pte), tok


def _valid(obj) -> bool:
    return (set(obj) == {"name", "age", "tags"} and obj["name"] in ("ada", "alan", "grace")
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
            and all(t in ("x", "y", "z") for t in obj["tags"]) and len(obj["tags"]) <= 4)


def test_check_resample_output_validates(tiny):
    decoder, tok = tiny
    constraint = Constraint("json_schema", SCHEMA)
    prompt = tok("Hello there")["input_ids"]
    resampled = [0]
    for seed in range(5):
        tokens = list(check_resample(decoder, prompt, 100, SamplingParams(temperature=1.0, seed=seed),
                                      constraint, resampled))
        assert tokens[-1] in decoder.meta.eos_token_ids, seed
        assert _valid(json.loads(tok.decode(tokens[:-1]))), seed
    assert resampled[0] > 0  # the resample path ran


def test_decode_rate_leaves_out_the_first_token():
    assert decode_rate(iter([1, 2, 3]))[0] == 2
