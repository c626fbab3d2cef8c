"""One self-describing .pte: metadata (a DecoderMeta flatbuffer) and tokenizer travel inside it (named data), a
renamed copy works, programs without this metadata (older exports) are refused with a line saying to re-export,
metadata that disagrees with the program is a clear error, and a batched program decodes one sequence exactly
like a batch-1 export of the same weights."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import asdict

import pytest
import torch

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.builtin.tiny_model import train_tokenizer, tiny_llama
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import (FILE_IDENTIFIER, META_KEY, OLD_META_KEY, TOKENIZER_PREFIX, DecoderMeta,
                                           StaleProgramError)
from backends.mlx.llm.decoder.step_inputs import SamplingParams
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.runtime.pte_metadata import PteFormatError, named_data
from backends.mlx.serialization import generate
from backends.mlx.serialization.generated.fb import DecoderMeta as fb_meta
from helpers import rewrite_named_data

MAX_SEQ_LEN = 40
TEXT = "Hello there! The quick brown fox, é 日本 🙂"
CONFIG = SamplerConfig(top_k=True, logit_bias=2)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, layers=1, seed=4)


@pytest.fixture(scope="module")
def ptes(model, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifact")
    one, three = root / "one.pte", root / "three.pte"
    export_decoder(model, one, MAX_SEQ_LEN, config=CONFIG, tokenizer=tokenizer)
    export_decoder(model, three, MAX_SEQ_LEN, config=CONFIG, batch=3, tokenizer=tokenizer)
    return one, three


def test_a_verified_export_frees_its_program_before_the_check(model, tokenizer, tmp_path):
    """The check loads the written file on top of what the export holds (issue 51): the program manager and the
    wrapper's KV cache are freed first; the result still reads as the file."""
    out = tmp_path / "freed.pte"
    result = export_decoder(model, out, MAX_SEQ_LEN, config=CONFIG, tokenizer=tokenizer)
    assert result.program is None and result.saved == out
    assert result.pte == out.read_bytes()
    with pytest.raises(RuntimeError, match="released after it was saved"):
        result.save(tmp_path / "again.pte")
    kept = export_decoder(model, tmp_path / "kept.pte", MAX_SEQ_LEN, config=CONFIG, tokenizer=tokenizer,
                          verify=False)
    assert kept.program is not None and kept.pte == (tmp_path / "kept.pte").read_bytes()  # control


def test_metadata_and_tokenizer_round_trip_inside_the_pte(ptes, tokenizer):
    one, _ = ptes
    assert sorted(p.name for p in one.parent.iterdir()) == ["one.pte", "three.pte"]  # no sidecar files
    blobs = named_data(one)
    assert {META_KEY, TOKENIZER_PREFIX + "tokenizer.json", TOKENIZER_PREFIX + "tokenizer_config.json"} <= set(blobs)
    meta = DecoderMeta.load(one)
    # The blob is the flatbuffer of decoder_meta.fbs: the generated reader alone sees the same values.
    assert blobs[META_KEY][4:8] == FILE_IDENTIFIER
    table = fb_meta.DecoderMeta.GetRootAs(blobs[META_KEY], 0)
    assert (table.MaxSeqLen(), table.Batch(), table.VocabSize(), table.Inputs(0)) == (MAX_SEQ_LEN, 1, len(tokenizer),
                                                                                     b"tokens")
    assert DecoderMeta.from_bytes(meta.to_bytes()) == meta and asdict(meta)["sampler"] == asdict(CONFIG)
    assert (meta.batch, meta.max_seq_len, meta.vocab_size) == (1, MAX_SEQ_LEN, len(tokenizer))
    assert meta.eos_token_ids == [tokenizer.eos_token_id] and meta.config == CONFIG
    decoder = Decoder(one)
    rebuilt = decoder.tokenizer
    assert rebuilt(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert rebuilt.chat_template == tokenizer.chat_template and rebuilt.eos_token == tokenizer.eos_token
    messages = [{"role": "user", "content": "hi"}]
    assert (rebuilt.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert named_data(one, ["absent"]) == {}


def test_renamed_and_moved_pte_keeps_working(ptes, tmp_path):
    one, _ = ptes
    moved = tmp_path / "elsewhere" / "renamed.model"
    moved.parent.mkdir()
    shutil.copy(one, moved)
    prompt = Decoder(one).tokenizer(TEXT)["input_ids"]
    decoder = Decoder(moved)
    assert decoder.has_tokenizer and decoder.tokenizer(TEXT)["input_ids"] == prompt
    assert decoder.generate(prompt, 6).tokens == Decoder(one).generate(prompt, 6).tokens


def test_every_dataclass_field_is_a_schema_field():
    """The dataclass and the table map by name: a field on one side only is caught here, not in a user's file."""
    schema = re.sub(r"//[^\n]*", "", generate.DECODER_META_SCHEMA.read_text())
    body = re.search(r"table DecoderMeta \{([^}]*)\}", schema).group(1)
    table_fields = [decl.split(":")[0].strip() for decl in body.split(";") if decl.strip()]
    assert table_fields == [f.name for f in dataclasses.fields(DecoderMeta)]


def test_program_without_this_metadata_is_refused(ptes, tmp_path):
    # A program without named data, like every export before the metadata moved inside.
    pte = export_to_pte(torch.nn.Linear(4, 2), (torch.ones(1, 4),)).save(tmp_path / "old.pte")
    assert named_data(pte) == {}
    with pytest.raises(StaleProgramError, match=r"old.pte carries no etmlx decoder metadata: re-export it"):
        DecoderMeta.load(pte)
    # One with the JSON of older exports: named in the message, and refused (no sidecar, no JSON reader).
    one, _ = ptes
    meta = DecoderMeta.load(one)
    json_era = rewrite_named_data(one, tmp_path / "json_era.pte",
                                  {META_KEY: None, OLD_META_KEY: json.dumps(asdict(meta)).encode()})
    (tmp_path / "json_era.pte.json").write_text(json.dumps(asdict(meta)))  # a sidecar beside it is not read
    with pytest.raises(StaleProgramError, match=r"json_era.pte carries older etmlx metadata \(JSON\): re-export it"):
        DecoderMeta.load(json_era)
    bad = rewrite_named_data(one, tmp_path / "bad.pte", {META_KEY: b"{not a flatbuffer}"})
    with pytest.raises(ValueError, match=r"bad.pte \(named data etmlx/decoder_meta\) is not etmlx decoder metadata"):
        DecoderMeta.load(bad)
    cut = rewrite_named_data(one, tmp_path / "cut.pte", {META_KEY: meta.to_bytes()[:40]})
    with pytest.raises(ValueError, match="cut.pte .* decoder metadata"):
        DecoderMeta.load(cut)
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(PteFormatError, match="not an ExecuTorch program"):
        named_data(junk)


def test_metadata_that_disagrees_with_the_program_is_a_clear_error(ptes, tmp_path):
    one, _ = ptes
    wrong_meta = dataclasses.replace(DecoderMeta.load(one), batch=2)
    wrong_batch = rewrite_named_data(one, tmp_path / "wrong_batch.pte", {META_KEY: wrong_meta.to_bytes()})
    assert DecoderMeta.load(wrong_batch).batch == 2
    with pytest.raises(ValueError, match=r"input 'tokens' is \[1, 40\] in the program but the metadata implies "
                                         r"\[2, 40\].*different exports"):
        Decoder(wrong_batch)
    meta = DecoderMeta.load(one)
    specs = [((1, MAX_SEQ_LEN), 4)] + [((1,), 4)] * 2 + [((1,), 6)] + [((1,), 4)] * 2 + [((1, 2), 4), ((1, 2), 6)]
    meta.check_program("p.pte", specs)  # the order the metadata lists
    with pytest.raises(ValueError, match="lists 8 inputs .* the program takes 7"):
        meta.check_program("p.pte", specs[:-1])
    swapped = specs[:3] + [specs[4], specs[3]] + specs[5:]  # temperature <-> seed
    with pytest.raises(ValueError, match="input 'temperature' has dtype code 4"):
        meta.check_program("p.pte", swapped)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=11),
                                    SamplingParams(temperature=0.8, seed=3, top_k=20)],
                         ids=["greedy", "seeded", "top_k"])
def test_batched_program_decodes_one_sequence_like_batch_one(ptes, params):
    one, three = ptes
    batched = Decoder(three)
    assert batched.meta.batch == 3
    prompt = batched.tokenizer(TEXT)["input_ids"][:12]
    got = batched.generate(prompt, 16, params).tokens
    assert got == Decoder(one).generate(prompt, 16, params).tokens and len(got) == 16
    if params.temperature:
        assert got != Decoder(one).generate(prompt, 16).tokens  # sampling, not the greedy path
