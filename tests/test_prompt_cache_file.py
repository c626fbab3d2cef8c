"""A prompt cache saved to a file and loaded into a freshly loaded program (etmlx.save_prompt_cache /
load_prompt_cache, llm/decoder/cache_file.py): the next turn's greedy and seeded tokens are those of the whole
conversation computed fresh, its prefill covers only the new tokens (counted from the program's inputs), and a
file is refused by another program, as is a non-cache file. A --kv-bits program's quantized cache goes through the
file the same way."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import etmlx
from backends.mlx.llm.decoder import cache_file
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.builtin.tiny_model import tiny_llama
from serve_helpers import eager_model

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64, 8, 2]
MORE = [33, 8, 91, 14]
CONFIG = SamplerConfig(top_k=True, penalties=True, logit_bias=2)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    model, tokenizer = eager_model()
    out = tmp_path_factory.mktemp("prompt_cache_file")
    paths = {}
    for name, pipelined, batch in (("plain", False, 2), ("pipelined", True, 2), ("other", False, 1)):
        paths[name] = out / f"{name}.pte"
        export_decoder(model, paths[name], 64, config=CONFIG, batch=batch, tokenizer=tokenizer, pipelined=pipelined,
                       verify=False)
    # --kv-bits 4: the file holds the packed keys and values (uint8) and their scales and biases; head size 32
    paths["kv4"] = out / "kv4.pte"
    export_decoder(tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=128), paths["kv4"], 64, config=CONFIG,
                   batch=2, tokenizer=tokenizer, pipelined=True, verify=False, kv_bits=4, kv_group_size=32)
    return paths


def _counted(model):
    """Record each call's per-row token counts (the `lengths` input) of `model`'s program."""
    calls, execute = [], model.method.execute

    def counting(inputs):
        calls.append(inputs[2].tolist())
        return execute(inputs)

    model.method.execute = counting
    return calls


def _no_eos(model, **sampling):
    return {"logit_bias": {model.meta.eos_token_ids[0]: -100}, **sampling}


@pytest.mark.parametrize("program", ["plain", "pipelined", "kv4"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7, "top_k": 40, "repetition_penalty": 1.2}],
                         ids=["greedy", "seeded"])
def test_a_cache_loaded_from_a_file_gives_the_fresh_tokens_and_prefills_only_the_new_ones(programs, tmp_path, program,
                                                                                         sampling):
    pte = programs[program]
    model = etmlx.load(pte)
    cache = etmlx.make_prompt_cache(model)
    first = [r.token for r in etmlx.stream_generate(model, PROMPT, 6, prompt_cache=cache, **_no_eos(model, **sampling))]
    path = tmp_path / "conversation.safetensors"
    etmlx.save_prompt_cache(path, cache, metadata={"turns": "1"})

    restored_model = etmlx.load(pte)  # a new program state: only the file knows the conversation
    restored, metadata = etmlx.load_prompt_cache(path, restored_model, return_metadata=True)
    assert metadata == {"turns": "1"}
    assert restored.tokens == PROMPT + first
    calls = _counted(restored_model)
    responses = list(etmlx.stream_generate(restored_model, MORE, 8, prompt_cache=restored,
                                           **_no_eos(model, **sampling)))
    # unpipelined: the last reply token was sampled, never fed; pipelined: fed back to the device too
    held = len(PROMPT) + len(first) - (0 if program in ("pipelined", "kv4") else 1)
    assert responses[-1].cached_tokens == held
    prefill = max(calls[0])  # the row's first call: every token it was not given from the file
    assert prefill == len(PROMPT) + len(first) + len(MORE) - held

    if program == "kv4":  # the quantized cache as the program holds it: packed bytes, then the scales and biases
        entries, _ = cache_file._read_safetensors(path)  # (bfloat16: a float32 program's default, kv_quant.py)
        assert [entries[f"kv.{k}"].dtype for k in range(6)] == [torch.uint8, torch.bfloat16, torch.bfloat16] * 2

    if program == "plain" and sampling:  # the file is plain safetensors: the library reads the same tensors
        safetensors = pytest.importorskip("safetensors.torch")
        entries = safetensors.load_file(str(path))
        assert entries["tokens"].tolist() == PROMPT + first
        ours, _ = cache_file._read_safetensors(path)
        assert len(entries) == len(ours) == 1 + len(restored_model.method.state.buffers)
        assert all(torch.equal(entries[name], ours[name]) for name in entries)
        assert all(entries[f"kv.{k}"].shape[1] == held for k in range(len(ours) - 1))

    fresh_model = etmlx.load(pte)
    fresh = [r.token for r in etmlx.stream_generate(fresh_model, PROMPT + first + MORE, 8,
                                                    **_no_eos(model, **sampling))]
    assert [r.token for r in responses] == fresh


def test_a_file_is_refused_by_another_program(programs, tmp_path):
    model = etmlx.load(programs["plain"])
    cache = etmlx.make_prompt_cache(model)
    list(etmlx.stream_generate(model, PROMPT, 3, prompt_cache=cache))
    path = tmp_path / "c.safetensors"
    etmlx.save_prompt_cache(path, cache)
    with pytest.raises(ValueError, match="saved from another program") as info:
        etmlx.load_prompt_cache(path, etmlx.load(programs["other"]))
    assert "\n" not in str(info.value)
    other = tmp_path / "not-a-cache.safetensors"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a prompt cache"):
        etmlx.load_prompt_cache(other, model)


def test_ring_programs_are_refused(programs, tmp_path):
    model = etmlx.load(programs["plain"])
    cache = etmlx.make_prompt_cache(model)
    model.meta.ring_cache = True  # as a sliding-window model's export records it
    with pytest.raises(ValueError, match="ring cache"):
        etmlx.save_prompt_cache(tmp_path / "c.safetensors", cache)


def _saved(programs, tmp_path):
    """A model of the plain program and a file it saved (six tokens generated after PROMPT)."""
    model = etmlx.load(programs["plain"])
    cache = etmlx.make_prompt_cache(model)
    list(etmlx.stream_generate(model, PROMPT, 6, prompt_cache=cache, **_no_eos(model)))
    path = tmp_path / "saved.safetensors"
    etmlx.save_prompt_cache(path, cache)
    return model, path


def _parts(path):
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + size]), bytearray(data[8 + size:])


def _write(path, header: dict | bytes, body: bytes, checksum: bool = True):
    """A file with this header and body; `checksum`: with the checksum it needs (to reach the later checks)."""
    if isinstance(header, dict):
        if checksum:
            header["__metadata__"].pop("checksum", None)
            header["__metadata__"]["checksum"] = cache_file._checksum(header, bytes(body))
        header = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(body))
    return path


def _refused(path, model, match):
    with pytest.raises(ValueError, match=match) as info:
        etmlx.load_prompt_cache(path, model)
    assert "\n" not in str(info.value)


def test_a_saved_file_loads_and_a_flipped_bit_in_its_kv_is_refused(programs, tmp_path):
    """The checksum covers the keys and values: one byte (0.777 -> 2.6e38 in the attack) or every sign flipped
    was a different reply with exit 0; now the file is refused. The unaltered file loads (the control)."""
    model, path = _saved(programs, tmp_path)
    header, body = _parts(path)
    start, end = header["kv.0"]["data_offsets"]
    assert end > start
    etmlx.load_prompt_cache(path, etmlx.load(programs["plain"]))  # the control: the file as saved loads
    flipped = bytearray(body)
    flipped[start + 3] ^= 0x40  # a float32's exponent byte
    _refused(_write(tmp_path / "flip.safetensors", json.loads(json.dumps(header)), flipped, checksum=False),
             model, "checksum does not match")
    negated = bytearray(body)
    kv = torch.frombuffer(negated, dtype=torch.uint8)[start:end].view(torch.float32)
    kv.neg_()
    _refused(_write(tmp_path / "neg.safetensors", json.loads(json.dumps(header)), negated, checksum=False),
             model, "checksum does not match")
    header.setdefault("__metadata__", {})["positions"] = "1"  # the metadata is covered too
    _refused(_write(tmp_path / "meta.safetensors", header, body, checksum=False), model, "checksum does not match")


def test_a_header_nested_too_deeply_is_refused(programs, tmp_path):
    model, _ = _saved(programs, tmp_path)
    _refused(_write(tmp_path / "list.safetensors", b"[" * 2_000_000, b""), model, "nested too deeply")
    deep = b'{"__metadata__": ' + b'{"a": ' * 200_000 + b"1" + b"}" * 200_001
    _refused(_write(tmp_path / "meta.safetensors", deep, b""), model, "nested too deeply")


@pytest.mark.parametrize("attack, match", [
    # as the attack's [-2, -53, 32]: the element count still matches the byte range
    (lambda h, b: h["kv.0"].update(shape=[-1, -h["kv.0"]["shape"][0], h["kv.0"]["shape"][1] * h["kv.0"]["shape"][2]]),
     "tensor 'kv.0' is described wrongly"),
    (lambda h, b: h["kv.0"].update(shape=[1.5]), "tensor 'kv.0' is described wrongly"),
    (lambda h, b: h["kv.0"].update(dtype="F64"), "tensor 'kv.0' is described wrongly"),
    (lambda h, b: h["kv.0"].update(data_offsets=[0, -1]), "tensor 'kv.0' is described wrongly"),
    (lambda h, b: h["kv.0"].update(extra=1), "tensor 'kv.0' is described wrongly"),
    (lambda h, b: h["__metadata__"].update(positions="abc"), "'positions' must be a count of tokens, got 'abc'"),
    (lambda h, b: h["__metadata__"].update(positions="-1"), "'positions' must be a count"),
    (lambda h, b: h["__metadata__"].update(positions="99999"), "99999 positions for 16 tokens"),
    (lambda h, b: h.update({"kv.99": h["kv.0"]}), "overlap|not this program's"),
    (lambda h, b: h.pop("kv.1"), "unaccounted|not this program's"),
    (lambda h, b: h["__metadata__"].update(nested="x") or h["__metadata__"].__setitem__("n", 1),
     "__metadata__ is not a table of strings"),
], ids=["negative_dims", "float_dim", "dtype", "offsets", "extra_key", "positions_text", "positions_negative",
        "positions_past_tokens", "extra_tensor", "missing_tensor", "metadata_number"])
def test_each_field_is_checked_before_use(programs, tmp_path, attack, match):
    """Files whose checksum matches (an attacker can compute it) but whose fields are wrong: one line each."""
    model, path = _saved(programs, tmp_path)
    header, body = _parts(path)
    attack(header, body)
    _refused(_write(tmp_path / "bad.safetensors", header, body), model, match)


def test_kv_and_tokens_must_fit_the_program(programs, tmp_path):
    model, path = _saved(programs, tmp_path)
    header, body = _parts(path)
    shape = header["kv.0"]["shape"]
    header["kv.0"]["shape"] = [shape[0] * 2, shape[1], shape[2] // 2]  # the same bytes, another layout
    if shape[2] % 2 == 0:
        _refused(_write(tmp_path / "kv.safetensors", header, body), model, "KV tensor 0 is")
    header, body = _parts(path)
    start, end = header["tokens"]["data_offsets"]
    body[start:start + 8] = struct.pack("<q", model.meta.vocab_size)
    _refused(_write(tmp_path / "ids.safetensors", header, body), model, rf"ids in \[0, {model.meta.vocab_size}\)")
    header, body = _parts(path)
    header["__metadata__"].pop("checksum")
    _refused(_write(tmp_path / "none.safetensors", json.dumps(header).encode(), body), model, "no checksum")
